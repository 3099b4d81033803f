"""Rank masking of the low-latency ops, for serving on with a peer that stopped responding.

While rank ``r`` is masked on the live ranks, their ``low_latency_dispatch`` and
``low_latency_combine`` neither send to ``r`` nor wait for it: entries of ``topk_idx`` that name
an expert of ``r`` count as ``-1`` (absent: they add nothing to the combine's sum) and no rows
come from ``r``. The spec is ``ep_backend.reference.low_latency_dispatch`` /
``low_latency_combine`` with ``mask``.

The mask is this rank's own view: setting it exchanges nothing (as in DeepEP), and every live
rank must mask the same ranks before its next low-latency call (the call's agreement checks it
and raises ``MoEError`` on every live rank otherwise). A masked rank must make no low-latency
call on the group while masked. Masked calls agree point-to-point among the live ranks over the
group's CPU backend instead of through shared memory: expect tens of microseconds more host time
per call while any rank is masked.

With ``low_latency_auto_mask(timeout)``, a peer that does not join a low-latency call within
``timeout`` seconds is masked, and the call goes on without it (``low_latency_query_mask``
reports it); the live ranks agree on whom they mask (a peer late for one rank's deadline is
masked by all), and a late rank that its peers masked raises instead of going on. Enable it on
every rank: a rank without it agrees through shared memory and never meets the ranks that have
it. On CUDA the NVSHMEM kernels read the mask from device memory (``int32 [R]``) at every
launch, so a CUDA graph captured before a change sees the new mask when replayed; a kernel
already waiting for a peer when it stops still ends by its ``kernel_timeout_s`` (the group must
then be aborted and re-created).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

from ._groups import Group, _group, get_backend

__all__ = [
    "low_latency_auto_mask",
    "low_latency_clean_mask",
    "low_latency_query_mask",
    "low_latency_update_mask",
]


def low_latency_update_mask(
    ranks: int | Iterable[int], masked: bool = True, group: Group = None
) -> None:
    """Masks (or, with ``masked=False``, unmasks) ``ranks`` in this rank's low-latency calls.

    Local: call it on every live rank before their next low-latency call. Unmasking a rank that
    missed calls does not bring it back (its calls are out of step: abort and re-create the
    group for that).

    Args:
        ranks: a rank of the group, or several.
        masked: mask (True) or unmask (False).
        group: an ``"ep"`` process group (default: WORLD).

    Raises:
        TypeError: ``ranks`` is not an int or an iterable of ints, or ``masked`` not a bool.
        ValueError: a rank outside the group, or this rank itself (it cannot mask itself).
    """
    if not isinstance(masked, bool):
        raise TypeError(f"masked must be a bool, got {type(masked).__name__}")
    targets = [ranks] if isinstance(ranks, int) else list(ranks)
    for rank in targets:
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"ranks must be ints, got {type(rank).__name__}")
    pg = _group(group)
    backend = get_backend(pg)
    # Every rank is checked before any is applied: a bad one leaves the mask as it was.
    size, me = pg.size(), pg.rank()
    for rank in targets:
        if not 0 <= rank < size:
            raise ValueError(
                f"ep low_latency_update_mask: rank {rank} is not in the group (size {size})"
            )
        if rank == me and masked:
            raise ValueError(f"ep low_latency_update_mask: rank {rank} cannot mask itself")
    for rank in targets:
        backend._low_latency_update_mask(rank, masked)


def low_latency_query_mask(group: Group = None) -> list[int]:
    """The ranks this rank masks in its low-latency calls (explicitly or automatically), ascending."""
    return list(get_backend(_group(group))._low_latency_mask())


def low_latency_clean_mask(group: Group = None) -> None:
    """Unmasks every rank (local; see ``low_latency_update_mask``)."""
    get_backend(_group(group))._low_latency_clean_mask()


def low_latency_auto_mask(timeout: float | datetime.timedelta | None, group: Group = None) -> None:
    """Masks, instead of failing the call, a peer that misses a low-latency call for ``timeout``.

    Args:
        timeout: seconds (float or ``timedelta``, positive) a live rank waits for a peer to join
            a low-latency call before masking it; ``None`` turns auto-masking off. While on,
            every low-latency call agrees point-to-point (see the module docstring). At least
            1 ms, at most 1e6 s.
        group: an ``"ep"`` process group (default: WORLD).

    Raises:
        TypeError / ValueError: ``timeout`` of another type, or outside [1 ms, 1e6 s] (NaN
            included).
    """
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise TypeError(f"timeout must be seconds or a timedelta, got {type(timeout).__name__}")
        # The native side adds it to a steady_clock time point (int64 ns): bounded well below that.
        if not 1e-3 <= timeout <= 1e6:
            raise ValueError(f"timeout must be between 1 ms and 1e6 s, got {timeout}")
        timeout = float(timeout)
    get_backend(_group(group))._low_latency_auto_mask(timeout)
