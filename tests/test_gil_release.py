"""The eager dispatch's native entry releases the GIL while it waits for its peers.

``ep_backend.dispatch`` on a plain CUDA tensor calls ``_C._dispatch_deferred`` directly (not
through ``torch.ops``, which releases the GIL itself). That call waits in the cross-rank
agreement, and the group's Gloo worker threads may need the GIL meanwhile (to drop a tensor whose
Python object they own): holding it deadlocks. The binding's behaviour does not depend on the
device, so this test calls it with CPU tensors: rank 1 arrives late, and a Python thread on
rank 0 must keep running while rank 0 waits for it.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from _dist_utils import run_distributed

LATE_S = 1.0


def _ticks_while_waiting(rank: int, world_size: int) -> dict[str, float]:
    import ep_backend as ep
    from ep_backend import reference as ref
    from ep_backend._groups import _group_info
    from ep_backend.moe import _native

    _, info = _group_info(None)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 16, generator=gen)
    idx = torch.randint(0, 4, (8, 2), generator=gen)
    w = torch.rand(8, 2, generator=gen)
    ep.dispatch(x, idx, w, 4)  # the group's first call sets up its agreement transport
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
    result, finish = _native()._dispatch_deferred(x, None, idx, w, 4, 1, 0, info.name, [])
    waited = time.monotonic() - start
    if finish is not None:
        finish()
    stop.set()
    thread.join()
    expected = ref.dispatch(x, idx, w, 4)
    return {
        "ticks": ticks,
        "waited": waited,
        "exact": float(torch.equal(result[0], expected.recv_x)),
    }


def test_dispatch_deferred_releases_the_gil_while_waiting_for_a_late_peer() -> None:
    results = run_distributed(_ticks_while_waiting, 2, backend="ep", timeout=120)
    early = results[0]
    assert all(r["exact"] == 1.0 for r in results), results
    assert early["waited"] > 0.5 * LATE_S, results  # it did wait for the late rank
    # A thread sleeping 1 ms per tick gets hundreds of ticks in the wait if the GIL is free, and
    # none (one at most, before the call took it) if the call holds it.
    assert early["ticks"] > 100, results
