"""Timeline of the NVLink-path ops: where a call's time goes between the host and the GPU.

Usage (GPU machine): python scripts/trace_ops.py [--tokens 4096] [--out DIR]
Runs one process per GPU, times dispatch (BF16, FP8), cached dispatch and combine the way the
bench does (L2 flushed, ranks lined up on the host), under torch.profiler, and prints for rank 0
each call's GPU work relative to the moment the call began on the host (µs): kernel and copy
names, starts and durations, and the host span of the call. Chrome traces go to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _events_in(events, start_ns: int, end_ns: int):
    out = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA and start_ns <= e.start_ns() <= end_ns:
            out.append(e)
    return sorted(out, key=lambda e: e.start_ns())


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import ep_backend as ep

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("ep", store=store, rank=rank, world_size=world)
    g = torch.Generator(device="cuda").manual_seed(rank)
    T, H, E, K = args.tokens, 7168, 256, 8
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    x8 = x.to(torch.float8_e4m3fn)
    s8 = torch.rand(T, H // 128, device="cuda", generator=g)
    scores = torch.rand(T, E, device="cuda", generator=g)
    w, idx = scores.topk(K, dim=1)
    w = w.float()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    cpu_group = dist.new_group(backend="gloo")

    state: dict = {}

    def do_dispatch():
        state["out"] = ep.dispatch(x, idx, w, E)

    def do_dispatch_fp8():
        ep.dispatch(x8, idx, w, E, x_scales=s8)

    def do_cached():
        ep.dispatch(x, handle=state["out"].handle)

    def do_combine():
        ep.combine(state["out"].recv_x, state["out"].handle)

    ops = [("dispatch", do_dispatch), ("dispatch_fp8", do_dispatch_fp8), ("cached", do_cached),
           ("combine", do_combine)]  # fmt: skip
    for _ in range(3):
        for _, fn in ops:
            do_dispatch()
            fn()
    torch.cuda.synchronize()
    marks: list[tuple[str, int, int]] = []
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for it in range(args.iters):
            for name, fn in ops:
                if name in ("cached", "combine"):
                    do_dispatch()
                flush.zero_()
                torch.cuda.synchronize()
                dist.barrier(group=cpu_group)
                with torch.profiler.record_function(f"call:{name}:{it}"):
                    fn()
                torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    for e in events:
        if e.name().startswith("call:"):
            _, name, it = e.name().split(":")
            marks.append((f"{name}#{it}", e.start_ns(), e.start_ns() + e.duration_ns()))
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"trace_rank{rank}.json"))
    if rank == 0:
        for label, start, end in sorted(marks, key=lambda m: m[1]):
            gpu = _events_in(events, start, end + 2_000_000)
            gpu = [e for e in gpu if "fill" not in e.name().lower() or e.duration_ns() < 50_000]
            line = [f"{label:16s} host {(end - start) / 1e3:7.1f} us |"]
            for e in gpu[:12]:
                line.append(f" {e.name()[:28]}@{(e.start_ns() - start) / 1e3:.1f}+"
                            f"{e.duration_ns() / 1e3:.1f}")  # fmt: skip
            print("".join(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):  # fmt: skip
        os.environ.setdefault(k, v)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=str, default=os.environ.get("OUT", "trace_out"))
    a = parser.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        sys.exit("needs 2 or more GPUs")
    mp.spawn(worker, args=(n, 29581, a), nprocs=n)
