"""``ep_backend.deep_ep``: DeepEP V1's Python API (the legacy ``Buffer``) running on ``ep``.

Code written for DeepEP's ``deep_ep.Buffer`` (Megatron-Core's flex dispatcher, vLLM's
``deepep_high_throughput`` / ``deepep_low_latency`` all2all backends, SGLang's DeepEP token
dispatcher) runs on ``ep``'s kernels after ``ep_backend.deep_ep.install()``, which makes
``import deep_ep`` give this package. Spawned workers: see ``deep_ep.install`` (the
``PYTHONPATH`` shim). Recipes: docs/integrations.md.

Contents, as DeepEP's ``deep_ep``: ``Buffer``, ``Config``, ``EventOverlap``, ``EventHandle``,
``topk_idx_t`` (``torch.int64``) and ``utils`` (``EventHandle``, ``EventOverlap``); plus
``install``, ``uninstall`` and ``shim_path``.
"""

from __future__ import annotations

import torch

from . import utils
from .buffer import Buffer
from .config import Config
from .install import install, shim_path, uninstall
from .utils import EventHandle, EventOverlap

topk_idx_t = torch.int64
"""dtype of top-k expert ids (DeepEP's default 64-bit build; int32 ids are accepted too)."""

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "EventOverlap",
    "install",
    "shim_path",
    "topk_idx_t",
    "uninstall",
    "utils",
]
