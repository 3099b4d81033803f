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

from collections.abc import Callable
from typing import Any

import torch

from ._native import native

_ops = torch.ops.ep
_C = native()
_has_torch_function = torch._C._has_torch_function


def _through_torch_ops(args: tuple[Any, ...]) -> bool:
    """Whether Python must see this call of an op: traced by torch.compile, or overridden."""
    return torch.compiler.is_compiling() or _has_torch_function(args)


def _op_call(name: str) -> Callable[..., Any]:
    """``ep::<name>`` called with the op's positional arguments, by whichever way fits the call."""
    overload = getattr(_ops, name).default
    entry = f"_call_{name}"

    def call(*args: Any) -> Any:
        if _through_torch_ops(args):
            return overload(*args)
        return getattr(_C, entry)(*args)

    call.__name__ = call.__qualname__ = f"_{name}_op"
    call.__doc__ = f"``ep::{name}``: ``{overload._schema}``."
    return call


_dispatch_op = _op_call("dispatch")
_layout_op = _op_call("dispatch_layout")
_cached_dispatch_op = _op_call("cached_dispatch")
_combine_op = _op_call("combine")
_low_latency_dispatch_op = _op_call("low_latency_dispatch")
_low_latency_combine_op = _op_call("low_latency_combine")
