"""Argument checks of the MoE functions, and how a rank that rejects its input tells its peers."""

from __future__ import annotations

from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ._custom_ops import _ops


def _reject(pg: dist.ProcessGroup, op: str, exc: Exception) -> NoReturn:
    """Raises ``exc`` on this rank after the agreement step of ``op``, so that no peer waits.

    Every argument check of the MoE functions that can fail on one rank only goes through here:
    the peers, already in the C++ op's agreement step, raise "rank(s) ... rejected their inputs"
    instead of waiting for this rank until the group times out.
    """
    try:
        _ops.reject(op, f"{exc}", pg.group_name)
    except RuntimeError:
        pass  # the expected outcome: the agreement step raised on every rank
    raise exc


def _require_tensor(value: Any, name: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")


def _require_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
