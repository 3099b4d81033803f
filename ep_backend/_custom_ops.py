"""The ``ep`` custom ops (``TORCH_LIBRARY(ep)``, from the native module), looked up once."""

from __future__ import annotations

import torch

_ops = torch.ops.ep
# The overloads themselves: calling the packet (torch.ops.ep.dispatch) resolves the overload
# on every call, several µs of host time on a slow host (benchmarks/host_overhead.py).
_dispatch_op = torch.ops.ep.dispatch.default
_cached_dispatch_op = torch.ops.ep.cached_dispatch.default
_combine_op = torch.ops.ep.combine.default
_layout_op = torch.ops.ep.dispatch_layout.default
_low_latency_dispatch_op = torch.ops.ep.low_latency_dispatch.default
_low_latency_combine_op = torch.ops.ep.low_latency_combine.default
