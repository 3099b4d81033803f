"""ep's ``all_to_all_single`` against the push limit at a few per-peer sizes: a quick A/B run.

    python benchmarks/a2a_quick.py [--ranks R] [--mib 64,256] [--iters 8]

One process per GPU; per size, ep's µs per call (``_bench_all_to_all``'s timing: the median of 5
loops of back-to-back calls, each after one untimed call that puts the ranks in step, the slowest
rank's) and the push limit with all SMs (every GPU pushing the same bytes to all its peers), their
GB/s per GPU and ep as % of the limit. The full section (``benchmarks/all_to_all.py``) also times
NCCL, the device-split and graph rows at every size from 4 KiB.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_backend import _bench_all_to_all as a2a


def _time_size(rank: int, world: int, size: int, iters: int, lib: str) -> tuple[float, float | str]:
    """(ep µs, push limit µs or why it did not run) at ``size`` bytes per peer, slowest rank's."""
    width = min(2048, size // 2)
    rows = size // 2 // width
    x = torch.randn(world * rows, width, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    ep = a2a._slowest(a2a._time_us(lambda: dist.all_to_all_single(y, x), iters))
    limit = a2a._push_limit(rank, world, size, iters, lib)
    return ep, (a2a._slowest(limit) if isinstance(limit, float) else limit)


def _worker(rank: int, world: int, sizes: list[int], iters: int, lib: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    import ep_backend  # noqa: F401 - registers "ep"

    dist.init_process_group("ep", rank=rank, world_size=world)
    for size in sizes:
        ep, limit = _time_size(rank, world, size, iters, lib)
        if rank == 0:
            out = size * (world - 1) / 1e3  # bytes a GPU sends, in kB: GB/s = kB / µs
            line = f"R={world} {a2a.size_label(size)}: ep {ep:.1f} µs {out / ep:.1f} GB/s"
            if isinstance(limit, float):
                line += f" | limit {limit:.1f} µs {out / limit:.1f} GB/s | {100 * limit / ep:.1f} %"
            else:
                line += f" | limit {limit}"
            print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--mib", default="64,256", help="per-peer sizes in MiB, comma-separated")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    if args.ranks < 2:
        raise SystemExit("needs at least 2 GPUs")
    sizes = [int(float(m) * (1 << 20)) for m in args.mib.split(",")]
    if any(s < 4096 or s % 4096 for s in sizes):
        raise SystemExit(f"--mib {args.mib}: each size must be a positive multiple of 4 KiB")
    lib = a2a.compile_push_limit()
    mp.spawn(_worker, args=(args.ranks, sizes, args.iters, lib, args.port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
