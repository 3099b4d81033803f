"""Getting back to work after a failed MoE call: ``abort`` a group, ``monitored_barrier`` on it.

After a ``MoETimeoutError`` the ranks' MoE calls on that group are out of step (one rank made a
call its peers never joined), so the group cannot be used for them again: every later MoE call
on it raises at once, on the rank that timed out and (ranks on one host) on its peers. The way
back, in the same process:

1. every live rank of the group calls ``ep_backend.abort(group)``: the group's transports
   (NVLink buffers and IPC mappings, NVSHMEM buffers) are released and the group is destroyed;
2. every live rank creates a new group (``torch.distributed.new_group(ranks, backend="ep")``)
   and uses it; it shares nothing with the aborted one but the process's NVSHMEM session, which
   is initialised once per process and reused by a new group over the same ranks (a group over
   other ranks, e.g. without a rank that died, runs its low-latency ops on ATen instead).

``monitored_barrier`` is torch's monitored barrier on an ``"ep"`` group (torch's own
``torch.distributed.monitored_barrier`` accepts only groups whose backend is named ``"gloo"``):
use it to find the rank that stopped calling.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ._groups import get_backend
from ._registration import BACKEND_NAME

__all__ = ["abort", "monitored_barrier"]


def _ep_group(group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup:
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(f"ep {what}: torch.distributed is not initialized")
    if dist.get_backend(pg) != BACKEND_NAME:
        raise ValueError(f"ep {what}: the group's backend is {dist.get_backend(pg)!r}, not 'ep'")
    return pg


def abort(group: dist.ProcessGroup | None = None) -> None:
    """Aborts ``group`` on this rank and destroys it, releasing everything it holds.

    Call it on every live rank of the group after a failure (a ``MoETimeoutError``, a peer that
    died), then create a new group on the same ranks (or, after a peer died, on the survivors:
    ``new_group(survivors, backend="ep", use_local_synchronization=True)``). Local: it waits for
    no other rank, except that a group whose low-latency ops ran on NVSHMEM waits up to the
    group timeout for its other ranks to tear it down too (freeing NVSHMEM buffers is collective;
    without a dead rank's vote it is skipped, see docs/api.md "Failures").

    What it does, in order:

    * marks the group's MoE calls unusable on this rank and tells its peers on this host: a peer
      still calling an MoE collective on the group raises ``MoETimeoutError`` naming this rank
      at once instead of waiting for its timeout;
    * aborts the internal Gloo (and NCCL) backends, so no later standard collective on the
      group waits;
    * destroys the group (``torch.distributed.destroy_process_group(group)``), which releases
      its NVLink buffers, IPC mappings and NVSHMEM buffers (NVSHMEM itself stays initialised:
      it cannot be re-initialised in a process). On CUDA a kernel still running on the
      group's buffers (one waiting for a dead peer) ends by its ``kernel_timeout_s`` first.

    Args:
        group: an ``"ep"`` group (default: the WORLD group; aborting WORLD destroys every group,
            and ``init_process_group`` needs a fresh store, or a new key prefix, to start again).

    Raises:
        ValueError: if the group does not use the ``"ep"`` backend.
    """
    pg = _ep_group(group, "abort")
    backend = get_backend(pg)
    backend.abort()  # see EPProcessGroup::abort: marks, abandons, aborts the inner backends
    dist.destroy_process_group(pg if group is not None else None)


def monitored_barrier(
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | float | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """torch's ``monitored_barrier`` on an ``"ep"`` group (or on any group torch's accepts).

    The same semantics as ``torch.distributed.monitored_barrier``, through the group's internal
    Gloo backend: the ranks other than 0 report to rank 0 and wait for its release; rank 0 raises
    ``RuntimeError`` "Rank r failed to pass monitoredBarrier in T ms" naming the first rank that
    did not arrive within ``timeout`` (every such rank with ``wait_all_ranks=True``), and the
    other ranks then raise too. Host-side only: CUDA work is not waited for.

    Args:
        group: the group (default: WORLD). A group of another backend is passed to torch's own.
        timeout: how long rank 0 waits for each rank (default: the group's timeout; a number
            is seconds, as torch accepts).
        wait_all_ranks: rank 0 collects every rank that failed to arrive, not only the first.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("ep monitored_barrier: torch.distributed is not initialized")
    if dist.get_backend(pg) != BACKEND_NAME:
        dist.monitored_barrier(group, timeout, wait_all_ranks)
        return
    if timeout is None:
        timeout = get_backend(pg).options.timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)  # as torch's: a number means seconds
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    # ProcessGroup.monitored_barrier is bound in C++ and missing from torch's type stubs.
    pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)  # type: ignore[attr-defined]
