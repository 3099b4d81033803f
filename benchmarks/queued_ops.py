"""Queued GPU time per call of the HT ops, for kernel A/Bs run as separate processes.

Usage (GPU machine): python benchmarks/queued_ops.py [--ranks R] [--tokens T] [--calls N]
[--loops L] [--num-sms S] [--label TEXT]

One process per GPU (or R), the bench's standard shape (BF16, H = 7168, top-8 of 256). Each
loop queues N calls of one op behind ``local_ranks.QueuedLead`` (host barrier, GPU sleep, L2
flush, GPUs in step) and times them with CUDA events: dispatch (layout given), dispatch of FP8
rows (per-128 scales), combine (of one BF16 dispatch's rows), and dispatch + combine pairs.
Prints, per op, the median over loops of the per-call time, the slowest rank's, on one line
starting with ``queued``, so that the lines of several builds or environment settings run one
after another compare directly.
"""

from __future__ import annotations

import argparse
import statistics

import local_ranks
import torch
import torch.distributed as dist


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import ep_backend as ep

    local_ranks.join_group(rank, world, port, timeout_s=120)
    if args.num_sms > 0:
        ep.get_backend().options.num_sms = args.num_sms
    x, idx, w = local_ranks.standard_inputs(args.tokens, rank)
    layout = ep.get_dispatch_layout(idx, 256)
    out = ep.dispatch(x, idx, w, 256, layout=layout)
    lead = local_ranks.QueuedLead()

    x8, s8 = ep.reference.quantize_fp8_per128(x)

    def dispatch() -> None:
        ep.dispatch(x, idx, w, 256, layout=layout)

    def dispatch_fp8() -> None:
        ep.dispatch(x8, idx, w, 256, layout=layout, x_scales=s8)

    def combine() -> None:
        ep.combine(out.recv_x, out.handle)

    def pair() -> None:
        o = ep.dispatch(x, idx, w, 256, layout=layout)
        ep.combine(o.recv_x, o.handle)

    ops = {"dispatch": dispatch, "dispatch FP8": dispatch_fp8, "combine": combine,
           "dispatch+combine": pair}  # fmt: skip
    per_call: dict[str, list[float]] = {name: [] for name in ops}
    for loop in range(args.loops + 1):
        for name, op in ops.items():
            start = lead.start()
            for _ in range(args.calls):
                op()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            if loop > 0:  # the first loop warms up
                per_call[name].append(start.elapsed_time(end) * 1e3 / args.calls)
    med = torch.tensor([statistics.median(v) for v in per_call.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        cols = ", ".join(f"{name} {us:7.1f}" for name, us in zip(ops, med.tolist(), strict=True))
        sms = args.num_sms if args.num_sms > 0 else "default"
        print(f"queued R={world} T={args.tokens} num_sms={sms} {args.label}: {cols} us per call "
              f"(median of {args.loops} loops of {args.calls}, slowest rank)", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=0, help="processes (default: every GPU)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--loops", type=int, default=5)
    parser.add_argument("--num-sms", type=int, default=0)
    parser.add_argument("--label", type=str, default="")
    parser.add_argument("--port", type=int, default=29583)
    a = parser.parse_args()
    n = a.ranks or torch.cuda.device_count()
    if n < 2:
        raise SystemExit("needs 2 or more GPUs")
    local_ranks.spawn(worker, (n, a.port, a), nprocs=n)
