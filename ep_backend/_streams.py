"""``async_op``: running an op on the backend's communication stream and handing back a ``Work``.

``async_op=True`` follows torch.distributed: the op runs on the backend's communication stream
after waiting for the current stream, and the returned ``work.wait()`` makes the *current stream*
wait for it (the CPU does not block). On CPU tensors the op completes before the call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ._native import native as _native

T = TypeVar("T")

_comm_streams: dict[int, torch.cuda.Stream] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _comm_streams:
        _comm_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _comm_streams[index]


# Each comm stream as (stream_id, device_index, device_type), what the C++ stream switch takes.
_comm_stream_ids: dict[int, tuple[int, int, int]] = {}


def _comm_ids(device: torch.device) -> tuple[int, int, int]:
    ids = _comm_stream_ids.get(device.index)  # type: ignore[arg-type]
    if ids is None:
        comm = _comm_stream(device)
        ids = (comm.stream_id, comm.device_index, comm.device_type)
        if device.index is not None:
            _comm_stream_ids[device.index] = ids
    return ids


def _completed_work(result: list[torch.Tensor]) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


def record_stream(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """``tensor.record_stream(stream)`` that also holds for the outputs of a dispatch.

    A dispatch on the NVLink path may return views of a receive slab (``Options.recv_slabs``),
    memory PyTorch's caching allocator does not own, so ``Tensor.record_stream`` ignores them.
    This function records ``stream`` on the slab instead: it is lent to a later dispatch only after
    the work queued on ``stream`` by the time the last of its views is freed. For any other
    tensor it is ``tensor.record_stream(stream)``.

    Args:
        tensor: a CUDA tensor (any dispatch output, or any other tensor).
        stream: a ``torch.cuda.Stream`` of the tensor's device that uses the tensor.

    Raises:
        TypeError: if ``tensor`` is not a tensor or ``stream`` not a CUDA stream.
        RuntimeError: if the stream is on another device than the tensor, or (from PyTorch) the
            tensor is not a CUDA tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a tensor, got {type(tensor).__name__}")
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    if not _native()._record_slab_stream(
        tensor, stream.stream_id, stream.device_index, stream.device_type
    ):
        tensor.record_stream(stream)


def _check_previous_event(previous_event: Any, device: torch.device) -> None:
    if previous_event is None:
        return
    if not isinstance(previous_event, torch.cuda.Event):
        raise TypeError(
            f"previous_event must be a torch.cuda.Event, got {type(previous_event).__name__}"
        )
    if device.type != "cuda":
        raise ValueError("previous_event needs CUDA tensors")


def _on_comm_stream(
    comm_ids: tuple[int, int, int],
    wait_current: bool,
    inputs: Iterable[torch.Tensor | None],
    body: Callable[[], tuple[T, list[torch.Tensor]]],
) -> T:
    """Runs ``body`` with the communication stream current, as ``with torch.cuda.stream(comm)``
    would, in two C++ calls (``native/backend/comm_stream_scope.hpp``).

    ``comm_ids``: the stream as ``(stream_id, device_index, device_type)``. ``wait_current``: the
    comm stream first waits for the current stream (False: the caller made it wait for what it
    must, e.g. ``previous_event``). ``body`` returns ``(result, outputs)``; after it the current
    stream is restored and ``ep_backend.record_stream`` records each input (``None`` skipped) on
    the comm stream and each output on the restored stream, so the caching allocator reuses
    neither before the stream that reads it is done. Returns ``result``.
    """
    native = _native()
    current_ids = native._enter_comm_stream(*comm_ids, wait_current)
    try:
        result, outputs = body()
    except BaseException:
        native._exit_comm_stream(current_ids, comm_ids, [], [])  # nothing to record
        raise
    native._exit_comm_stream(current_ids, comm_ids, [t for t in inputs if t is not None], outputs)
    return result


def _run(
    fn: Callable[[], Any],
    inputs: Sequence[torch.Tensor | None],
    device: torch.device,
    async_op: bool,
    outputs_of: Callable[[Any], list[torch.Tensor]],
    previous_event: torch.cuda.Event | None = None,
) -> tuple[Any, dist.Work | None]:
    """Runs ``fn`` synchronously (current stream) or asynchronously (comm stream + Work).

    ``previous_event`` (checked by the caller): what the op waits for; with ``async_op`` instead
    of the current stream.
    """
    if not async_op:
        if device.type == "cuda" and device.index not in _comm_streams:
            # At the first CUDA call, async or not: torch's first stream taken from its pool on a
            # device holds the host until that device's queued work has ended, which a later
            # async_op call must not do.
            _comm_stream(device)
        if previous_event is not None:
            torch.cuda.current_stream(device).wait_event(previous_event)
        return fn(), None
    if device.type != "cuda":
        result = fn()
        return result, _completed_work(outputs_of(result))
    if previous_event is not None:
        _comm_stream(device).wait_event(previous_event)

    def body() -> tuple[tuple[Any, torch.futures.Future], list[torch.Tensor]]:
        result = fn()
        outputs = list(outputs_of(result))
        fut: torch.futures.Future = torch.futures.Future(devices=[device])
        fut.set_result(outputs)  # records an event on the comm stream, current here
        return (result, fut), outputs

    # Outputs (receive-slab views too: with previous_event a later dispatch's comm stream need
    # not wait for the current stream, which may still read them) are recorded for the current
    # stream, inputs for the comm stream.
    result, fut = _on_comm_stream(_comm_ids(device), previous_event is None, inputs, body)
    return result, torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]
