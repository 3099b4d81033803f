"""All-to-all bench: ep (host splits), ep (device splits), NCCL all_to_all_single,
torch symm_mem all_to_all_vdev where it runs, and the all-peer push limit, in one run.

    python benchmarks/all_to_all.py [--ranks R] [--iters N] [--png out.png]

The command line of one rank count for ``ep_backend/_bench_all_to_all.py``, the section that
``python -m ep_backend.bench`` runs at 2 ranks and at every GPU (its docstring says what each row
and column is). One process per GPU (R defaults to every visible GPU). Per-peer sizes 4 KiB ..
256 MiB; every row moves the same bytes. Prints a line per size (µs and GB/s per row, host µs per
call of the ep and NCCL rows, ``ep host splits`` x NCCL and % of the push limit) and the line of
issue 42's targets; ``--png`` also plots time and GB/s over the sizes.
"""

from __future__ import annotations

import argparse

import torch

from ep_backend import _bench_all_to_all as a2a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--png", default="")
    args = parser.parse_args()
    if args.ranks < 2:
        raise SystemExit("needs at least 2 GPUs")
    lib = a2a.compile_push_limit()
    results = a2a.run(args.ranks, args.iters, args.port, lib)
    print("\n".join(a2a.format_table(results, args.ranks)))
    if args.png:
        if a2a.plot({args.ranks: results}, args.png):
            print(f"plot: {args.png}")
        else:
            print("plot: not written (no matplotlib)")


if __name__ == "__main__":
    main()
