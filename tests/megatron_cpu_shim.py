"""Test-only: lets Megatron-Core's MoE code run on CPU tensors, in a process without CUDA.

Megatron's MoE layer, router and token dispatchers call CUDA stream and device functions
unconditionally, even when every tensor is on the CPU (``MoEAlltoAllTokenDispatcher`` creates a
``torch.cuda.Stream()`` in its constructor and waits on it around its device-to-host copies; the
router moves its weight to ``torch.cuda.current_device()``). ``install()`` replaces these
``torch.cuda`` attributes, in this process only, with CPU stand-ins:

===============================  ==========================================================
``torch.cuda.Stream``            an object whose ``wait_stream``, ``wait_event``,
                                 ``record_event``, ``synchronize`` do nothing (CPU ops are
                                 complete when they return, so there is nothing to order)
``torch.cuda.Event``             an event that is always complete (``record``, ``wait``,
                                 ``synchronize`` do nothing; ``query()`` is True)
``torch.cuda.current_stream``,   the one stand-in stream
``torch.cuda.default_stream``
``torch.cuda.stream(s)``         a context manager that does nothing
``torch.cuda.current_device``    ``torch.device("cpu")``: Megatron's ``device=`` arguments
                                 then place tensors on the CPU
``torch.cuda.synchronize``       nothing
===============================  ==========================================================

One Megatron function is replaced too, after Megatron is imported (``patch_megatron()``):
``maybe_move_tensor_to_cpu(t, as_numpy=True)`` (``moe_utils``, and its binding in
``token_dispatcher``) converts only CUDA tensors to NumPy; on CPU the alltoall dispatcher's split
sizes would then reach ``all_to_all_single`` as tensors, which it rejects. The stand-in also
converts CPU tensors when ``as_numpy`` is set; otherwise it is Megatron's function. And
``CudaRNGStatesTracker.fork`` (entered around attention dropout whatever the dropout rate) is a
context manager that does nothing: it would swap the CUDA generator's state. The tests that use
this shim set every dropout to 0, so no random numbers are drawn inside it.

``torch.cuda.is_available()`` stays False, so ``ep`` and the ``deep_ep`` facade keep taking
their CPU paths (the facade's ``EventHandle`` records no CUDA event without an initialised
CUDA context). It refuses to run where CUDA is available: there the real functions are needed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["install", "patch_megatron"]


class _CompletedEvent:
    """A CUDA event stand-in that has always completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream stand-in: CPU ops complete in program order, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CompletedEvent:
        return event if event is not None else _CompletedEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _CpuStream()


def install() -> None:
    """Replaces the ``torch.cuda`` attributes listed in the module docstring (idempotent).

    Raises:
        RuntimeError: CUDA is available in this process.
    """
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu_shim is for processes without CUDA")
    cuda = torch.cuda
    cuda.Stream = _CpuStream  # type: ignore[misc,assignment]
    cuda.Event = _CompletedEvent  # type: ignore[misc,assignment]
    cuda.current_stream = lambda device=None: _STREAM  # type: ignore[assignment]
    cuda.default_stream = lambda device=None: _STREAM  # type: ignore[assignment]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def patch_megatron() -> None:
    """Replaces Megatron's ``maybe_move_tensor_to_cpu`` as the module docstring says; call it
    after importing ``megatron.core.transformer.moe.token_dispatcher`` (idempotent)."""
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    megatron_random.CudaRNGStatesTracker.fork = (  # type: ignore[method-assign]
        lambda self, name=None: contextlib.nullcontext()
    )

    original = getattr(moe_utils.maybe_move_tensor_to_cpu, "__wrapped__", None)
    original = original or moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False,
                                 record_stream: bool = False) -> Any:  # fmt: skip
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
