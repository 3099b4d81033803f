"""DeepEP's ``deep_ep.utils``: ``EventHandle`` and ``EventOverlap`` over ``ep``'s streams.

DeepEP V1 hands back an ``EventOverlap`` from every call: with ``async_finish=True`` it holds an
event recorded on the communication stream after the op, and ``current_stream_wait()`` (or
leaving a ``with`` block) makes the current stream wait for it. The facade keeps that meaning:
its ops with ``async_finish=True`` run on the facade's communication stream
(``Buffer.get_comm_stream()``) and the event is recorded there.

On CPU tensors every op has completed when the call returns; the events are then already
complete and waiting on them does nothing.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EventHandle", "EventOverlap"]


def _cuda_ready() -> bool:
    """Whether a CUDA event can be recorded here (CUDA present and already initialised).

    A process that never touched CUDA (a CPU-only run) gets completed events instead of
    initialising CUDA for nothing.
    """
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class EventHandle:
    """An event recorded on the current CUDA stream when constructed (DeepEP's ``EventHandle()``).

    Without an initialised CUDA context (CPU runs) it is an event that has already completed.

    Args:
        event: an existing ``torch.cuda.Event`` to wrap instead of recording a new one.
    """

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        if event is not None and not isinstance(event, torch.cuda.Event):
            raise TypeError(f"event must be a torch.cuda.Event, got {type(event).__name__}")
        if event is None and _cuda_ready():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        self.event: torch.cuda.Event | None = event

    def current_stream_wait(self) -> None:
        """Makes the current CUDA stream wait for this event (nothing to wait for on CPU)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        return f"EventHandle({'cuda' if self.event is not None else 'completed'})"


class EventOverlap:
    """DeepEP's ``EventOverlap``: an optional ``EventHandle`` plus tensors to keep alive.

    Args:
        event: the ``EventHandle`` of an ``async_finish=True`` call, else ``None``.
        extra_tensors: tensors kept alive as long as this object (DeepEP's substitute for
            ``record_stream`` under CUDA graphs).

    ``current_stream_wait()`` makes the current stream wait for the event; ``with ev: ...``
    does the same when the block exits.
    """

    __slots__ = ("event", "extra_tensors")

    def __init__(
        self, event: EventHandle | None = None, extra_tensors: tuple[Any, ...] | None = None
    ) -> None:
        if event is not None and not isinstance(event, EventHandle):
            raise TypeError(f"event must be an EventHandle or None, got {type(event).__name__}")
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event.

        Raises:
            RuntimeError: if there is no event (the call was not ``async_finish=True``), as
                DeepEP's assertion does.
        """
        if self.event is None:
            raise RuntimeError(
                "deep_ep (ep): this EventOverlap holds no event; only calls with "
                "async_finish=True (or Buffer.capture()) return one to wait on"
            )
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap({self.event!r})"
