"""Where the host time of the NVLink-path HT ops goes (2 ranks, one GPU each).

Usage: EP_PROFILE_HOST=1 python benchmarks/profile_ops.py [T]

For layout, dispatch, cached dispatch and combine: the median host time of the call and of its
Python pieces (group lookup, the bare custom op), the GPU time of back-to-back calls, and a
torch.profiler summary (CUDA runtime calls and kernels) of a few calls on rank 0. With
EP_PROFILE_HOST=1 the C++ side also prints its stage times per call on stderr.
"""

import json
import os
import re
import statistics
import sys
import time

import local_ranks
import torch
import torch.distributed as dist


def _median_host(fn, iters: int = 30) -> float:
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _timeline(path: str) -> str:
    """Per ep:: op of a chrome trace: when each CUDA launch was issued, and when its kernel ran."""
    events = json.load(open(path))["traceEvents"]
    kernels = {e["args"].get("correlation"): e for e in events if e.get("cat") == "kernel"}
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e["name"]]
    lines = []
    for op in sorted((e for e in events if e.get("cat") == "cpu_op"
                      and e["name"].startswith("ep::")), key=lambda e: e["ts"]):  # fmt: skip
        t0, t1 = op["ts"], op["ts"] + op["dur"]
        cells = [f"{op['name']} host {op['dur']:.0f}"]
        for launch in (e for e in launches if t0 <= e["ts"] <= t1):
            k = kernels.get(launch["args"].get("correlation"))
            if k is None:
                continue
            ours = re.search(r"intranode_(\w+?)_kernel", k["name"])
            name = ours.group(1) if ours else k["name"][:40]
            cells.append(f"{name}: launch {launch['ts'] - t0:.0f}+{launch['dur']:.0f} "
                         f"run {k['ts'] - t0:.0f}..{k['ts'] + k['dur'] - t0:.0f}")  # fmt: skip
        lines.append("  " + " | ".join(cells))
    return "\n".join(lines)


def worker(rank: int, tokens: int, port: int) -> None:
    import ep_backend as ep
    from ep_backend import moe
    from ep_backend.bench import gpu_us_per_call

    local_ranks.join_group(rank, 2, port)
    x, idx, w = local_ranks.standard_inputs(tokens, rank)
    pg = dist.group.WORLD
    out = ep.dispatch(x, idx, w, 256)
    y = out.recv_x
    name = pg.group_name
    ops = {
        "layout": lambda: ep.get_dispatch_layout(idx, 256),
        "layout bare op": lambda: torch.ops.ep.dispatch_layout(idx, 256, 2),
        "_group(None)": lambda: moe._group(None),
        "group_name": lambda: pg.group_name,
        "dispatch": lambda: ep.dispatch(x, idx, w, 256),
        "dispatch bare op": lambda: torch.ops.ep.dispatch(x, None, idx, w, 256, 1, 0, name),
        "cached dispatch": lambda: ep.dispatch(x, handle=out.handle),
        "combine": lambda: ep.combine(y, out.handle),
    }
    lines = []
    for op, fn in ops.items():
        if op == "combine":  # as in a model (and the bench): right after its own dispatch
            fresh = ep.dispatch(x, idx, w, 256)
            fn = ops[op] = lambda fresh=fresh: ep.combine(fresh.recv_x, fresh.handle)
        for _ in range(5):
            fn()
        host = _median_host(fn)
        gpu = gpu_us_per_call(fn, 30)
        lines.append(f"rank {rank} {op:18s} host {host:8.1f} us   back-to-back {gpu:8.1f} us/call")
    print("\n".join(lines), file=sys.stderr, flush=True)

    from torch.profiler import ProfilerActivity, profile

    out_dir = os.environ.get("OUT", ".")
    for op in ("layout", "dispatch", "dispatch host-first", "combine"):
        options = ep.get_backend().options
        options.overlap_dispatch_host_wait = op != "dispatch host-first"
        fn = ops[op.split(" ")[0]]
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                torch.cuda.synchronize()
                dist.barrier()
                fn()
            torch.cuda.synchronize()
        path = os.path.join(out_dir, f"trace_{op.replace(' ', '_')}_rank{rank}.json")
        prof.export_chrome_trace(path)
        print(f"rank {rank} {op}: per call, µs from the op's start\n{_timeline(path)}",
              file=sys.stderr, flush=True)  # fmt: skip
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
            print(f"==== profiler: {op} (6 calls, rank 0)\n{table}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    local_ranks.spawn(worker, (tokens, 29578))
