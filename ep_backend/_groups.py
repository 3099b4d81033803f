"""The ``"ep"`` process group of a call: its backend object and the state kept per group."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._native import native
from ._registration import BACKEND_NAME

Group = dist.ProcessGroup | None
if TYPE_CHECKING:
    from ._C import EPProcessGroup
else:
    EPProcessGroup = native().EPProcessGroup


class _GroupInfo:
    """What the MoE functions read of an ``"ep"`` group on every call, read once.

    A group's name and size are fixed at its creation (an aborted group is replaced by a new one,
    with a new name), and ``ProcessGroup.group_name`` / ``size()`` cost a Python to C++ crossing
    each, several per call. ``pending``: the transports (``"high_throughput"``, ``"low_latency"``,
    ``"all_to_all"``) whose choice for CUDA tensors is yet to be checked for a fallback to ATen
    (``_fallback._check_fallback``).
    """

    __slots__ = ("ref", "name", "size", "pending", "nodes", "backend")

    def __init__(self, pg: dist.ProcessGroup, on_collect: Callable[[Any], None]) -> None:
        self.ref = weakref.ref(pg, on_collect)
        self.name: str = pg.group_name
        self.size: int = pg.size()
        self.pending: set[str] = {"high_throughput", "low_latency", "all_to_all"}
        self.nodes: tuple[int, ...] | None = None  # _node_of_rank, read at its first use
        self.backend: EPProcessGroup | None = None  # _backend_of, read at its first use


# Groups already seen to have backend "ep" (a group's backend never changes), by id(): a plain
# dict lookup, where a WeakKeyDictionary made a weak reference per call. Each entry holds its group
# weakly (the identity check below also refuses a new group at a recycled id) and leaves with it;
# a call on a destroyed group still held fails in the op, which resolves the group by name.
_infos: dict[int, _GroupInfo] = {}


def _forget(key: int) -> Callable[[Any], None]:
    def forget(ref: Any) -> None:
        info = _infos.get(key)
        if info is not None and info.ref is ref:
            del _infos[key]

    return forget


def get_backend(group: Group = None) -> EPProcessGroup:
    """The ``EPProcessGroup`` behind ``group`` (default: the WORLD group).

    Raises:
        ValueError: if the group does not use the ``"ep"`` backend.
        RuntimeError: if torch.distributed is not initialized.
    """
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("ep: torch.distributed is not initialized")
    backend = pg._get_backend(torch.device("cpu"))
    wrapped = getattr(backend, "wrapped_pg", None)  # TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper
    if wrapped is not None:
        backend = wrapped
    if not isinstance(backend, EPProcessGroup):
        raise ValueError(f"ep: group uses backend {dist.get_backend(pg)!r}, not {BACKEND_NAME!r}")
    return backend


def _group_info(group: Group) -> tuple[dist.ProcessGroup, _GroupInfo]:
    """The ``"ep"`` group (default WORLD) and what the MoE functions read of it per call."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("ep: torch.distributed is not initialized; call init_process_group")
    key = id(pg)
    info = _infos.get(key)
    if info is not None and info.ref() is pg:
        return pg, info
    backend = dist.get_backend(pg)
    if backend != "ep":
        raise ValueError(f"ep: the MoE collectives need a group with backend 'ep', got {backend!r}")
    info = _infos[key] = _GroupInfo(pg, _forget(key))
    return pg, info


def _group_state(group: Group) -> tuple[dist.ProcessGroup, set[str]]:
    """The ``"ep"`` group (default WORLD) and its transports still to check (``_check_fallback``)."""
    pg, info = _group_info(group)
    return pg, info.pending


def _backend_of(pg: dist.ProcessGroup, info: _GroupInfo) -> EPProcessGroup:
    """``get_backend(pg)``, read once per group (``info``: ``_group_info(pg)[1]``)."""
    if info.backend is None:
        info.backend = get_backend(pg)
    return info.backend


def _node_of_rank(pg: dist.ProcessGroup) -> tuple[int, ...]:
    """``[R]`` node of each rank of an ``"ep"`` group (fixed at its creation; read once)."""
    info = _group_info(pg)[1]
    if info.nodes is None:
        info.nodes = tuple(_backend_of(pg, info)._topology()[2])
    return info.nodes


def _group(group: Group) -> dist.ProcessGroup:
    return _group_info(group)[0]


def _group_of(backend: EPProcessGroup) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = backend.options.group_name
    if not name:
        raise RuntimeError("ep: this backend is not attached to a named process group")
    # (torch 2.13+ types the name as GroupName, a str at run time)
    return _resolve_process_group(name)  # type: ignore[arg-type]


def _bind_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: EPProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is not None:
            raise TypeError("ep: the group of a backend method is the backend's own group")
        kwargs["group"] = _group_of(self)
        return fn(*args, **kwargs)

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


def _bind_backend_methods(functions: tuple[Callable[..., Any], ...]) -> None:
    """Makes each of ``functions`` (which take ``group=``) a method of the group's backend."""
    for fn in functions:
        setattr(EPProcessGroup, fn.__name__, _bind_method(fn))
