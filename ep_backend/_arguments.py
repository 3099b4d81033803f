"""Argument checks of the MoE functions (a failed one goes through ``_failures._reject``)."""

from __future__ import annotations

from typing import Any

import torch


def _require_tensor(value: Any, name: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")


def _require_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _require_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
