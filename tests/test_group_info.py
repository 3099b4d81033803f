"""The per-group cache of the MoE functions (``ep_backend._groups._group_info``).

Each call reads a group's name and size from it instead of ``ProcessGroup.group_name`` /
``size()`` (a Python to C++ crossing each). These tests check that the cache never hands a call
another group's name or size: not for a new group, not for an entry found at a recycled ``id``,
and that an entry leaves with its group.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from _dist_utils import run_distributed


def _group_info_worker(rank: int, world: int) -> dict[str, Any]:
    import ep_backend as ep
    from ep_backend import _groups

    out: dict[str, Any] = {}
    world_pg = dist.group.WORLD
    pg, info = _groups._group_info(None)
    out["world"] = (pg is world_pg, info.name == world_pg.group_name, info.size == world)

    other = dist.new_group(backend="ep")
    pg2, info2 = _groups._group_info(other)
    out["other"] = (pg2 is other, info2.name == other.group_name, info2.name != info.name)

    # An entry whose group is not the one at that id (a recycled id) is replaced, not used.
    _groups._infos[id(world_pg)] = info2
    _, fresh = _groups._group_info(world_pg)
    out["recycled_id"] = (fresh is not info2, fresh.name == world_pg.group_name)

    # A handle of one group is refused on another: the check compares the cached names.
    x = torch.randn(4, 16).bfloat16()
    idx = torch.randint(0, 2 * world, (4, 2))
    handle = ep.dispatch(x, idx, None, 2 * world, group=other).handle
    try:
        ep.combine(torch.zeros(handle.recv_src_idx.shape[0], 16).bfloat16(), handle)
        out["foreign_handle"] = None
    except ep.MoEInputError as exc:
        out["foreign_handle"] = str(exc)
    ep.combine(torch.zeros(handle.recv_src_idx.shape[0], 16).bfloat16(), handle, group=other)

    # A group that is not "ep" is refused and not cached.
    gloo = dist.new_group(backend="gloo")
    try:
        _groups._group_info(gloo)
        out["gloo"] = None
    except ValueError as exc:
        out["gloo"] = (str(exc), id(gloo) in _groups._infos)

    # The entry leaves with its group.
    key = id(other)
    dist.destroy_process_group(other)
    del other, pg2, info2, handle
    gc.collect()
    out["forgotten"] = key not in _groups._infos
    return out


def test_group_info_is_each_groups_own_and_leaves_with_it() -> None:
    for res in run_distributed(_group_info_worker, 2, backend="ep", timeout=120):
        assert res["world"] == (True, True, True)
        assert res["other"] == (True, True, True)
        assert res["recycled_id"] == (True, True)
        assert res["foreign_handle"] is not None
        assert "the handle was made on group" in res["foreign_handle"]
        message, cached = res["gloo"]
        assert "backend 'ep'" in message and not cached
        assert res["forgotten"]
