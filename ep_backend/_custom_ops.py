"""The ``ep`` custom ops (``TORCH_LIBRARY(ep)``, from the native module), and how Python calls them.

``torch.ops.ep.<op>.default(...)`` parses its arguments against the schema in Python and boxes
them before the dispatcher runs the kernel; on a host whose caches went cold between calls that
costs tens of µs per call (docs/performance.md, "Host time per call"). Where nothing in Python
needs to see the call, the ``_*_op`` functions below hand the same arguments to the native
module's ``_call_*`` entries instead, which call the op through the typed (unboxed) dispatcher
(``native/backend/moe_op_calls.hpp``): the same kernels, autograd keys, dispatch modes
(``FakeTensorMode``, ``make_fx``), ``__torch_dispatch__`` subclasses and profiler names. Python
must see it under ``torch.compile``'s tracing and where an argument or a mode overrides
``__torch_function__``: those calls take ``torch.ops``.
"""

from __future__ import annotations

from typing import Any

import torch

from ._native import native

_ops = torch.ops.ep
_C = native()
_has_torch_function = torch._C._has_torch_function


def _through_torch_ops(args: tuple[Any, ...]) -> bool:
    """Whether Python must see this call of an op: traced by torch.compile, or overridden."""
    return torch.compiler.is_compiling() or _has_torch_function(args)


def _dispatch_op(*args: Any) -> tuple[torch.Tensor, ...]:
    """``ep::dispatch(x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
    num_worst_tokens, group_name, layout)``."""
    if _through_torch_ops(args):
        return _ops.dispatch.default(*args)
    return _C._call_dispatch(*args)


def _layout_op(*args: Any) -> tuple[torch.Tensor, ...]:
    """``ep::dispatch_layout(topk_idx, num_experts, num_ranks)``."""
    if _through_torch_ops(args):
        return _ops.dispatch_layout.default(*args)
    return _C._call_dispatch_layout(*args)


def _cached_dispatch_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``ep::cached_dispatch(x, x_scales, *routing, group_name)``."""
    if _through_torch_ops(args):
        return _ops.cached_dispatch.default(*args)
    return _C._call_cached_dispatch(*args)


def _combine_op(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``ep::combine(x, topk_weights, bias0, bias1, *routing, group_name)``."""
    if _through_torch_ops(args):
        return _ops.combine.default(*args)
    return _C._call_combine(*args)


def _low_latency_dispatch_op(*args: Any) -> tuple[torch.Tensor, ...]:
    """``ep::low_latency_dispatch(x, topk_idx, M, E, use_fp8, round_scale, use_ue8m0,
    group_name, send_only)``."""
    if _through_torch_ops(args):
        return _ops.low_latency_dispatch.default(*args)
    return _C._call_low_latency_dispatch(*args)


def _low_latency_combine_op(*args: Any) -> torch.Tensor:
    """``ep::low_latency_combine(x, topk_idx, topk_weights, src_info, layout_range, M,
    group_name)``."""
    if _through_torch_ops(args):
        return _ops.low_latency_combine.default(*args)
    return _C._call_low_latency_combine(*args)
