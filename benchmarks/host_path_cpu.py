"""Host time of the MoE call path's pieces that run without a GPU (issue #43, item 3).

    python benchmarks/host_path_cpu.py [--iters N] [--rounds R] [--ranks 2 4 8]

Three tables, µs per call, medians over rounds of each round's median (rows take turns within a
round, as in ``host_overhead.py``: a shared host's speed drifts):

* ``python``: the Python layer of ``ep.dispatch`` / cached dispatch / ``combine`` /
  ``get_dispatch_layout`` / ``low_latency_dispatch`` / ``low_latency_combine`` on one rank, with
  the custom op replaced by a stub that returns preallocated tensors: what the wrappers themselves
  cost (argument checks, group lookup, ``_run``, result objects). The stub's own call is its first
  row.
* ``native``: the same calls on CPU tensors with the real ops, one rank, one token: the
  dispatcher, the registry, validation and the ATen transport (no agreement at one rank).
* ``agreement``: ``EPProcessGroup._reserve`` for a CPU device on R local processes: validation
  plus the per-call agreement (the shared-memory all-gather, ``HostExchange``), back to back.
  On a host with fewer cores than ranks the ranks' spin-waits share cores: read it as an upper
  bound there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T, H, K, E = 1, 128, 2, 8
LL_M = 4  # low-latency M (tokens per rank at most)


def _median_us(fn: Callable[[], object], iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples[iters // 5 :])


def _table(rows: dict[str, Callable[[], object]], iters: int, rounds: int) -> dict[str, float]:
    for fn in rows.values():  # warm up
        for _ in range(20):
            fn()
    per_round: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            per_round[name].append(_median_us(fn, iters))
    return {name: statistics.median(v) for name, v in per_round.items()}


def _init(rank: int, world: int, path: str) -> None:
    import ep_backend  # noqa: F401  (registers the "ep" backend)

    store = dist.FileStore(path, world)
    dist.init_process_group("ep", store=store, rank=rank, world_size=world)


def _one_rank_tables(iters: int, rounds: int) -> None:
    import ep_backend as ep
    from ep_backend import low_latency, moe

    with tempfile.TemporaryDirectory() as tmp:
        _init(0, 1, os.path.join(tmp, "store"))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, H, generator=g).bfloat16()
        idx = torch.randint(0, E, (T, K), generator=g)
        w = torch.rand(T, K, generator=g)
        layout = ep.get_dispatch_layout(idx, E)
        out = ep.dispatch(x, idx, w, E)
        handle = out.handle
        y = out.recv_x
        ll = ep.low_latency_dispatch(x, idx, LL_M, E, use_fp8=False)
        native = {
            "get_dispatch_layout": lambda: ep.get_dispatch_layout(idx, E),
            "dispatch": lambda: ep.dispatch(x, idx, w, E),
            "dispatch, layout given": lambda: ep.dispatch(x, idx, w, E, layout=layout),
            "cached dispatch": lambda: ep.dispatch(x, handle=handle),
            "combine": lambda: ep.combine(y, handle),
            "low_latency_dispatch BF16": lambda: ep.low_latency_dispatch(x, idx, LL_M, E,
                                                                         use_fp8=False),
            "low_latency_combine": lambda: ep.low_latency_combine(ll.recv_x, idx, w, ll.handle),
        }  # fmt: skip
        real = _table(native, iters, rounds)

        # The same calls with each custom op stubbed: its results, made once.
        dispatch_result = tuple(moe._dispatch_op(x, None, idx, w, E, 1, 0, "0", []))
        layout_result = tuple(moe._layout_op(idx, E, 1))
        cached_result = tuple(moe._cached_dispatch_op(x, None, *moe._routing(handle), "0"))
        combine_result = tuple(moe._combine_op(y, None, None, None, *moe._routing(handle), "0"))
        ll_dispatch_result = tuple(low_latency._low_latency_dispatch_op(
            x, idx, LL_M, E, False, False, False, "0", False))  # fmt: skip
        ll_combine_result = low_latency._low_latency_combine_op(
            ll.recv_x, idx, w, ll.handle.src_info, ll.handle.layout_range, LL_M, "0"
        )
        ll_ops = (low_latency._low_latency_dispatch_op, low_latency._low_latency_combine_op)
        saved = (moe._dispatch_op, moe._layout_op, moe._cached_dispatch_op, moe._combine_op)
        moe._dispatch_op = lambda *a: dispatch_result
        moe._layout_op = lambda *a: layout_result
        moe._cached_dispatch_op = lambda *a: cached_result
        moe._combine_op = lambda *a: combine_result
        low_latency._low_latency_dispatch_op = lambda *a: ll_dispatch_result
        low_latency._low_latency_combine_op = lambda *a, **k: ll_combine_result
        try:
            stub = {"the stub alone": lambda: moe._dispatch_op(x), **native}
            python = _table(stub, iters, rounds)
        finally:
            moe._dispatch_op, moe._layout_op, moe._cached_dispatch_op, moe._combine_op = saved
            low_latency._low_latency_dispatch_op, low_latency._low_latency_combine_op = ll_ops
        dist.destroy_process_group()
    print(f"{'call (1 rank, CPU)':<28} {'python (op stubbed)':>20} {'native (real op)':>18}")
    print(f"{'the stub alone':<28} {python['the stub alone']:>20.2f} {'':>18}")
    for name in native:
        print(f"{name:<28} {python[name]:>20.2f} {real[name]:>18.2f}")


def _agreement_worker(rank: int, world: int, path: str, iters: int, rounds: int, out) -> None:
    torch.set_num_threads(1)
    _init(rank, world, path)
    import ep_backend as ep

    backend = ep.get_backend()
    call = lambda: backend._reserve(-1, 128, 2 * 7168, 8, 56, 64)  # noqa: E731
    medians = []
    for _ in range(20):
        call()
    for _ in range(rounds):
        medians.append(_median_us(call, iters))
    mine = torch.tensor([statistics.median(medians)])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.put((float(mine[0]), backend.moe_agreement_transport))
    dist.destroy_process_group()


def _agreement(world: int, iters: int, rounds: int) -> tuple[float, str]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_agreement_worker, args=(r, world, path, iters, rounds, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    result = queue.get(timeout=1)
                    break
                except Exception:  # queue.Empty: stop at once when a rank failed
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError("a rank failed (see its traceback)") from None
                    if time.monotonic() > deadline:
                        raise
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200, help="timed calls per row and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--skip-one-rank", action="store_true")
    args = parser.parse_args()
    if not args.skip_one_rank:
        _one_rank_tables(args.iters, args.rounds)
    for world in args.ranks:
        us, how = _agreement(world, args.iters, args.rounds)
        print(
            f"agreement (_reserve, CPU) at {world} ranks: {us:.2f} µs per call (max over ranks; "
            f"through {how}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
        )


if __name__ == "__main__":
    main()
