"""Registration of the ``"ep"`` backend with torch.distributed and its creator function."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from . import _topology
from ._native import native

BACKEND_NAME = "ep"
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def _cuda_usable() -> bool:
    return (
        bool(native().cuda_enabled or torch.version.cuda is not None)
        and torch.cuda.is_available()
        and dist.is_nccl_available()
    )


def _name_group(options: Any, group_name: str, global_ranks: list[int] | None) -> None:
    """Sets the group's name and global ranks, where given, on ep's or NCCL's ``Options``."""
    if group_name:
        options.group_name = group_name
    if global_ranks:
        options.global_ranks_in_group = list(global_ranks)


def _make_gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)


def _make_nccl(
    store: Any,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    group_name: str,
    global_ranks: list[int] | None,
) -> Any:
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    _name_group(opts, group_name, global_ranks)
    return ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, opts)


def _instance_store(store: Any, size: int) -> Any:
    """``store`` under a key prefix of this group instance's own.

    torch names a group made with ``use_local_synchronization=True`` after its ranks, so a group
    re-created over the same ranks (the recovery path after ``ep_backend.abort``, the ``deep_ep``
    facade's groups) gets its destroyed predecessor's name and key space: a rank of the new group
    could read a key the old one left (IPC handles, shared-memory names, votes) before its peer
    overwrote it. Every member adds 1 to a counter once per instance, so the instances of one
    name number 0, 1, 2, ... on every rank alike (collective, like the group's creation).
    """
    joined = int(store.add("ep_instances", 1))
    return PrefixStore(f"ep_instance{(joined - 1) // size}/", store)


def make_backend(
    store: Any,
    rank: int,
    size: int,
    options: Any | None = None,
    *,
    timeout: datetime.timedelta | None = None,
    group_name: str = "",
    global_ranks: list[int] | None = None,
) -> Any:
    """Builds an ``EPProcessGroup`` over ``store`` (internal Gloo for CPU, NCCL for CUDA)."""
    _C = native()
    if options is None:
        options = _C.Options()
    elif not isinstance(options, _C.Options):
        raise TypeError(
            f"ep: pg_options must be ep_backend.Options or None, got {type(options).__name__}"
        )
    if timeout is not None:
        options.timeout = timeout
    _name_group(options, group_name, global_ranks)
    store = _instance_store(store, size)
    gloo = _make_gloo(store, rank, size, options.timeout)
    nccl = (
        _make_nccl(store, rank, size, options.timeout, group_name, global_ranks)
        if _cuda_usable()
        else None
    )
    backend = _C.EPProcessGroup(store, rank, size, options, gloo, nccl)
    # Collective, like the group's creation itself: every rank learns the nodes (or raises alike).
    _topology.install(
        backend, _topology.discover(store, group_name, rank, size, options.ranks_per_node)
    )

    def split_factory(child_store: Any, child_rank: int, child_size: int, child_opts: Any) -> Any:
        return make_backend(
            child_store,
            child_rank,
            child_size,
            child_opts,
            group_name=child_opts.group_name,
            global_ranks=list(child_opts.global_ranks_in_group),
        )

    backend._set_split_factory(split_factory)
    if group_name:
        backend._register_group_name(group_name)
    return backend


def _create_backend(dist_backend_opts: Any, pg_options: Any | None) -> Any:
    """Creator called by torch.distributed (``extended_api=True``) for every new "ep" group."""
    return make_backend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        pg_options,
        timeout=dist_backend_opts.timeout or _DEFAULT_TIMEOUT,
        group_name=str(dist_backend_opts.group_id or ""),
        global_ranks=list(dist_backend_opts.global_ranks_in_group or []),
    )


def register() -> None:
    """Registers ``"ep"`` for CPU and CUDA tensors; idempotent."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )
