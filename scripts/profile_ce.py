"""GPU timeline of dispatches on 2 ranks: the layout, notify and dispatch kernels and the
copy-engine copies (profiler trace, rank 0, µs from the layout kernel's start), with the copy
engine on and off (Options.dispatch_copy_engine).

Usage: python scripts/profile_ce.py [T] [fp8]
"""

import json
import os
import statistics
import sys
import tempfile

import local_ranks
import torch
import torch.distributed as dist


def _timeline(trace: str) -> list[list[tuple[str, float, float]]]:
    events = json.load(open(trace))["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e),
        key=lambda e: e["ts"],
    )
    calls, cur = [], None
    for e in gpu:
        name = e["name"]
        if "intranode_layout" in name:
            cur = []
            calls.append(cur)
            t0 = e["ts"]
        if cur is None:
            continue
        short = "copy" if e["cat"] == "gpu_memcpy" else name.split("(")[0].split("::")[-1]
        cur.append((short, e["ts"] - t0, e["ts"] + e["dur"] - t0))
    return calls


def worker(rank: int, world: int, port: int, tokens: int, fp8: bool) -> None:
    import ep_backend as ep  # registers the "ep" backend

    local_ranks.join_group(rank, world, port)

    x, idx, w = local_ranks.standard_inputs(tokens, rank)
    scales = None
    if fp8:
        x, scales = ep.reference.quantize_fp8_per128(x)
    options = ep.get_backend().options
    for ce in (True, False):
        options.dispatch_copy_engine = ce
        for _ in range(20):
            ep.dispatch(x, idx, w, 256, x_scales=scales)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                torch.cuda._sleep(2_000_000)  # the host runs ahead: launches are not timed
                ep.dispatch(x, idx, w, 256, x_scales=scales)
            torch.cuda.synchronize()
        if rank != 0:
            continue
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        calls = _timeline(path)[1:]
        print(f"== copy engine {'on' if ce else 'off'}: {len(calls)} calls (rank 0, µs)")
        for call in calls[:3]:
            print("   " + "  ".join(f"{n} {a:.1f}-{b:.1f}" for n, a, b in call))
        ends = [max(b for _, _, b in call) for call in calls]
        print(f"   span median {statistics.median(ends):.1f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    fp8 = len(sys.argv) > 2 and sys.argv[2] == "fp8"
    local_ranks.spawn(worker, (2, 29581, tokens, fp8))
