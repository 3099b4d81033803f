"""Timeline of the NVLink-path ops: where a call's time goes between the host and the GPU.

Usage (GPU machine): python benchmarks/trace_ops.py [--tokens 4096] [--out DIR] [--sweep CFG ...]
Runs one process per GPU and calls dispatch (BF16, FP8), cached dispatch and combine the way the
bench does (L2 flushed, ranks lined up on the host) under torch.profiler. For rank 0 it prints,
per op, the median over calls of: the host span of the call, when each GPU kernel started after
the call began and how long it ran (µs). Chrome traces go to --out.

--sweep SMS:DW:CW ... repeats the measurement on a fresh group per configuration: SMS blocks
(``Options.num_sms``), DW dispatch and CW combine send warps per block (EP_DISPATCH_SEND_WARPS,
EP_COMBINE_SEND_WARPS), e.g. ``--sweep 24:10:5 24:12:4``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import local_ranks
import torch
import torch.distributed as dist

OPS = ("dispatch", "dispatch_fp8", "cached", "combine")


def _short(name: str) -> str:
    name = name.replace("(anonymous namespace)", "").split("(")[0]
    return name.rsplit("::", 1)[-1].replace("intranode_", "").replace("_kernel", "")[:24]


def _profile(args, group, data, label: str, rank: int) -> None:
    import ep_backend as ep

    x, x8, s8, idx, w, flush, cpu_group = data
    E = 256
    state: dict = {}

    def do_dispatch():
        state["out"] = ep.dispatch(x, idx, w, E, group=group)

    calls = {
        "dispatch": do_dispatch,
        "dispatch_fp8": lambda: ep.dispatch(x8, idx, w, E, x_scales=s8, group=group),
        "cached": lambda: ep.dispatch(x, handle=state["out"].handle, group=group),
        "combine": lambda: ep.combine(state["out"].recv_x, state["out"].handle, group=group),
    }
    for _ in range(3):
        for name in OPS:
            do_dispatch()
            calls[name]()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for it in range(args.iters):
            for name in OPS:
                if name in ("cached", "combine"):
                    do_dispatch()
                flush.zero_()
                torch.cuda.synchronize()
                dist.barrier(group=cpu_group)
                with torch.profiler.record_function(f"call:{name}:{it}"):
                    calls[name]()
                torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    kernels = sorted(
        (e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA
         and not e.name().startswith("call:")),
        key=lambda e: e.start_ns(),
    )  # fmt: skip
    spans: dict[str, list[float]] = {}
    stages: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CPU or not e.name().startswith("call:"):
            continue
        _, name, _ = e.name().split(":")
        start, end = e.start_ns(), e.start_ns() + e.duration_ns()
        spans.setdefault(name, []).append(e.duration_ns() / 1e3)
        per = stages.setdefault(name, {})
        # The call's kernels: launched inside the span (they may run after it ends).
        for k in kernels:
            if start <= k.start_ns() <= end + 1_500_000 and "vectorized" not in k.name():
                per.setdefault(_short(k.name()), []).append(
                    ((k.start_ns() - start) / 1e3, k.duration_ns() / 1e3)
                )
                if "dispatch_kernel" in k.name() or "combine" in k.name():
                    break  # the op's last kernel
    if label == "default":
        os.makedirs(args.out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out, f"trace_rank{rank}.json"))
    if rank == 0:
        print(f"[{label}] median µs over {args.iters} calls: host span | kernel @start +duration")
        for name in OPS:
            parts = [f"  {name:13s} host {statistics.median(spans.get(name, [0])):6.1f} |"]
            for k, v in stages.get(name, {}).items():
                s = statistics.median(a for a, _ in v)
                d = statistics.median(b for _, b in v)
                parts.append(f" {k} @{s:.0f} +{d:.1f}")
            print("".join(parts), flush=True)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import ep_backend as ep

    local_ranks.join_group(rank, world, port, timeout_s=120)
    g = torch.Generator(device="cuda").manual_seed(rank)
    T, H, E, K = args.tokens, 7168, 256, 8
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    x8 = x.to(torch.float8_e4m3fn)
    s8 = torch.rand(T, H // 128, device="cuda", generator=g)
    w, idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    cpu_group = dist.new_group(backend="gloo")
    data = (x, x8, s8, idx, w.float(), flush, cpu_group)
    _profile(args, None, data, "default", rank)
    for cfg in args.sweep:
        sms, dw, cw = (int(v) for v in cfg.split(":"))
        os.environ.update(EP_DISPATCH_SEND_WARPS=str(dw), EP_COMBINE_SEND_WARPS=str(cw))
        group = dist.new_group(backend="ep", pg_options=ep.Options(num_sms=sms))
        label = f"num_sms={sms} send warps {dw}/{cw}"
        _profile(args, group, data, label, rank)
        dist.destroy_process_group(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sweep", nargs="*", default=[], metavar="SMS:DW:CW")
    parser.add_argument("--out", type=str, default=os.environ.get("OUT", "trace_out"))
    a = parser.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        sys.exit("needs 2 or more GPUs")
    local_ranks.spawn(worker, (n, 29581, a), nprocs=n)
