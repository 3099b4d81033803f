"""Host time of one HT call on an idle GPU after a host barrier (the bench's "host" column), per op.

Usage (GPU machine): python benchmarks/host_idle_calls.py [--ranks R] [--iters N] [--label TEXT]

One process per GPU (or R, sharing GPUs when there are fewer: the host path is the same, the
kernels are not link figures), the bench's standard shape (BF16, T = 4096, H = 7168, top-8 of 256).
Each sample synchronises the GPU, meets the other ranks at the bench's host barrier (they leave it
within µs of each other) and times one call on the host: ``get_dispatch_layout``, dispatch with
the layout given, cached dispatch and combine, in turn. Prints one line starting with ``host``:
per op, the median over samples (the first 3 left out), the slowest rank's, µs. Lines of several
builds run one after another compare directly (``--label``).

With ``EP_PROFILE_HOST=1 ... 2>>LOG``, ``python benchmarks/stage_medians.py LOG`` splits those
calls into their C++ stages and the agreement's wait: unlike the bench's log, every call here is
an idle call after a barrier, so the arrival skew it prints is the one the "host" column holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import local_ranks
import torch
import torch.distributed as dist


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import ep_backend as ep
    from ep_backend.bench import _host_barrier

    local_ranks.join_group(rank, world, port, timeout_s=120)
    num_experts = 256
    x, idx, w = local_ranks.standard_inputs(4096, rank, experts=num_experts)
    layout = ep.get_dispatch_layout(idx, num_experts)
    out = ep.dispatch(x, idx, w, num_experts, layout=layout)
    ops = {
        "layout": lambda: ep.get_dispatch_layout(idx, num_experts),
        "dispatch": lambda: ep.dispatch(x, idx, w, num_experts, layout=layout),
        "cached dispatch": lambda: ep.dispatch(x, handle=out.handle),
        "combine": lambda: ep.combine(out.recv_x, out.handle),
    }
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(args.iters + 3):
        for name, fn in ops.items():
            torch.cuda.synchronize()
            _host_barrier()
            t0 = time.perf_counter()
            result = fn()
            samples[name].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            del result
    medians = torch.tensor([statistics.median(v[3:]) for v in samples.values()],
                           dtype=torch.float64)  # fmt: skip
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if rank == 0:
        cells = "  ".join(
            f"{name} {us:.1f}" for name, us in zip(ops, medians.tolist(), strict=True)
        )
        print(f"host {args.label} R={world}: {cells} µs (median, slowest rank)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=0, help="processes (default: every GPU, >= 2)")
    parser.add_argument("--iters", type=int, default=40, help="samples per op")
    parser.add_argument("--label", type=str, default="")
    parser.add_argument("--port", type=int, default=29585)
    a = parser.parse_args()
    n = a.ranks or max(2, torch.cuda.device_count())
    local_ranks.spawn(worker, (n, a.port, a), nprocs=n)


if __name__ == "__main__":
    main()
