"""The ``"ep"`` group a ``Buffer`` runs on: the caller's group itself, or one made once per rank set.

DeepEP's ``Buffer`` takes whatever group the framework has: Megatron passes its NCCL expert
group, vLLM its CPU Gloo group. ``ep``'s MoE collectives need an ``"ep"`` group, so the facade
creates one over the same global ranks (``new_group``, collective over those ranks only, as
``Buffer``'s construction is in DeepEP) and keeps it for every later ``Buffer`` on those ranks.
The cache belongs to the default process group: destroying it (``destroy_process_group``)
drops the cache with it.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

import ep_backend

__all__ = ["ep_group_for"]

# WORLD group -> {global ranks -> "ep" group}. Weak keys: a destroyed world's groups go with it.
_cache: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def ep_group_for(group: dist.ProcessGroup | None, num_sms: int) -> dist.ProcessGroup:
    """The ``"ep"`` process group over the ranks of ``group`` (default: WORLD).

    ``group`` itself when its backend is ``"ep"``; otherwise a group created on the first call
    for these ranks (every rank of ``group`` must make that first call, as for any
    ``new_group``) and cached. ``num_sms`` seeds the new group's ``Options.num_sms``.

    Raises:
        RuntimeError: if torch.distributed is not initialised.
        TypeError: if ``group`` is not a ``ProcessGroup``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "deep_ep (ep): torch.distributed is not initialized; call init_process_group before "
            "creating a Buffer"
        )
    world = dist.group.WORLD
    assert world is not None
    pg = world if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(pg).__name__}")
    if dist.get_backend(pg) == ep_backend.BACKEND_NAME:
        return pg
    ranks = tuple(dist.get_process_group_ranks(pg))
    groups = _cache.setdefault(world, {})
    cached = groups.get(ranks)
    if cached is None:
        options = ep_backend.Options()
        options.num_sms = num_sms
        cached = dist.new_group(
            list(ranks),
            backend=ep_backend.BACKEND_NAME,
            pg_options=options,
            use_local_synchronization=True,
        )
        groups[ranks] = cached
    return cached
