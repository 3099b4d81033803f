"""The native entries of eager MoE calls release the GIL while they wait for their peers.

``ep_backend.dispatch`` on a plain CUDA tensor calls ``_C._dispatch_deferred``, and the other
plain eager calls ``_C._call_<op>`` (``tests/test_op_calls.py``), not ``torch.ops`` (which
releases the GIL itself). Those calls wait in the cross-rank agreement, and the group's Gloo
worker threads may need the GIL meanwhile (to drop a tensor whose Python object they own):
holding it deadlocks. The bindings' behaviour does not depend on the device, so these tests call
them with CPU tensors: rank 1 arrives late, and a Python thread on rank 0 must keep running while
rank 0 waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _dist_utils import run_distributed

LATE_S = 1.0


def _ticks_while(call: Callable[[], bool], rank: int) -> dict[str, float]:
    """Runs ``call`` (rank 1 after ``LATE_S``) while a thread ticks every 1 ms; its result is
    whether the call's output was exact."""
    dist.barrier()
    ticks = 0
    stop = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    if rank == 1:
        time.sleep(LATE_S)
    thread = threading.Thread(target=tick)
    thread.start()
    start = time.monotonic()
    exact = call()
    waited = time.monotonic() - start
    stop.set()
    thread.join()
    return {"ticks": ticks, "waited": waited, "exact": float(exact)}


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 16, generator=gen)
    idx = torch.randint(0, 4, (8, 2), generator=gen)
    w = torch.rand(8, 2, generator=gen)
    return x, idx, w


def _deferred_dispatch(rank: int, world_size: int) -> dict[str, float]:
    import ep_backend as ep
    from ep_backend import reference as ref
    from ep_backend._groups import _group_info
    from ep_backend.moe import _native

    _, info = _group_info(None)
    x, idx, w = _inputs(rank)
    ep.dispatch(x, idx, w, 4)  # the group's first call sets up its agreement transport

    def call() -> bool:
        result, finish = _native()._dispatch_deferred(x, None, idx, w, 4, 1, 0, info.name, [])
        if finish is not None:
            finish()
        return torch.equal(result[0], ref.dispatch(x, idx, w, 4).recv_x)

    return _ticks_while(call, rank)


def _combine(rank: int, world_size: int) -> dict[str, float]:
    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank)
    out = ep.dispatch(x, idx, w, 4)

    def call() -> bool:  # a CPU combine goes through _C._call_combine
        combined = ep.combine(out.recv_x, out.handle).combined_x
        return torch.equal(combined, ref.combine(out.recv_x, out.handle).combined_x)

    return _ticks_while(call, rank)


def _check(results: list[dict[str, float]]) -> None:
    early = results[0]
    assert all(r["exact"] == 1.0 for r in results), results
    assert early["waited"] > 0.5 * LATE_S, results  # it did wait for the late rank
    # A thread sleeping 1 ms per tick gets hundreds of ticks in the wait if the GIL is free, and
    # none (one at most, before the call took it) if the call holds it.
    assert early["ticks"] > 100, results


def test_dispatch_deferred_releases_the_gil_while_waiting_for_a_late_peer() -> None:
    _check(run_distributed(_deferred_dispatch, 2, backend="ep", timeout=120))


def test_call_combine_releases_the_gil_while_waiting_for_a_late_peer() -> None:
    _check(run_distributed(_combine, 2, backend="ep", timeout=120))
