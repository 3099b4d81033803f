"""DeepEP's stream flags (``previous_event``, ``async_finish``, ``allocate_on_comm_stream``) on ep.

DeepEP runs every op on its buffer's communication stream and, without ``async_finish``, makes
the current stream wait for it. The facade runs ``ep``'s synchronous ops:

* ``async_finish=False``: on the current stream, after ``previous_event`` when one is given
  (the result is the same as DeepEP's: the current stream sees the outputs in order).
* ``async_finish=True``: on the facade's communication stream, which first waits for
  ``previous_event`` (or, without one, for the current stream); an event recorded there after
  the op comes back in the ``EventOverlap``. Inputs are recorded on the communication stream
  and outputs on the current one (``ep_backend.record_stream``, which also covers dispatch
  outputs in ep's receive slabs), so the caching allocator reuses neither too early.
  Outputs are allocated on the communication stream, as DeepEP's ``allocate_on_comm_stream=True``;
  with ``False`` DeepEP allocates them on the current stream: same memory, another pool.

On CPU tensors the ops complete before the call returns; the events are complete already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from .._streams import _on_comm_stream
from .utils import EventHandle, EventOverlap

__all__ = ["CommStreams", "check_flags", "completed_event", "cuda_event_of"]

T = TypeVar("T")


def completed_event() -> EventHandle:
    """An ``EventHandle`` that has already completed (what CPU ops return)."""
    handle = object.__new__(EventHandle)
    handle.event = None
    return handle


def cuda_event_of(previous_event: Any) -> torch.cuda.Event | None:
    """The CUDA event behind DeepEP's ``previous_event`` (``EventOverlap``, ``EventHandle``,
    a ``torch.cuda.Event`` or ``None``); ``None`` when there is nothing to wait for."""
    if previous_event is None:
        return None
    if isinstance(previous_event, EventOverlap):
        previous_event = previous_event.event
        if previous_event is None:
            return None
    if isinstance(previous_event, EventHandle):
        return previous_event.event
    if isinstance(previous_event, torch.cuda.Event):
        return previous_event
    raise TypeError(
        "previous_event must be an EventOverlap, EventHandle or torch.cuda.Event, got "
        f"{type(previous_event).__name__}"
    )


def check_flags(previous_event: Any, async_finish: Any, allocate_on_comm_stream: Any) -> None:
    """DeepEP's rules for the flags: booleans; ``allocate_on_comm_stream`` needs both others."""
    for name, value in (("async_finish", async_finish), ("allocate_on_comm_stream", allocate_on_comm_stream)):  # fmt: skip
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(
            "allocate_on_comm_stream=True needs previous_event and async_finish=True (as in DeepEP)"
        )


class CommStreams:
    """The facade's communication stream per CUDA device, and the runner of its ops."""

    __slots__ = ("_streams",)

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def get(self, device: torch.device | None = None) -> torch.cuda.Stream:
        """The communication stream of ``device`` (default: the current CUDA device)."""
        if not torch.cuda.is_available():
            raise RuntimeError("deep_ep (ep): the communication stream needs CUDA")
        index = (
            torch.cuda.current_device() if device is None or device.index is None else device.index
        )
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index, priority=-1)
        return stream

    def run(
        self,
        fn: Callable[[], T],
        device: torch.device,
        previous_event: Any,
        async_finish: bool,
        inputs: Iterable[torch.Tensor | None],
        outputs_of: Callable[[T], Iterable[torch.Tensor | None]],
    ) -> tuple[T, EventOverlap]:
        """Runs ``fn`` with DeepEP's stream semantics; returns its result and the event."""
        event = cuda_event_of(previous_event)
        if device.type != "cuda":
            return fn(), EventOverlap(completed_event() if async_finish else None)
        if not async_finish:
            if event is not None:
                torch.cuda.current_stream(device).wait_event(event)
            return fn(), EventOverlap(None)
        comm = self.get(device)
        if event is not None:
            comm.wait_event(event)

        def body() -> tuple[T, list[torch.Tensor]]:
            result = fn()
            return result, [t for t in outputs_of(result) if t is not None]

        comm_ids = (comm.stream_id, comm.device_index, comm.device_type)
        result = _on_comm_stream(comm_ids, event is None, inputs, body)
        # Recorded on comm itself: its event follows the op whatever the current device.
        return result, EventOverlap(EventHandle(comm.record_event()))
