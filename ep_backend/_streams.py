"""``async_op``: running an op on the backend's communication stream and handing back a ``Work``.

``async_op=True`` follows torch.distributed: the op runs on the backend's communication stream
after waiting for the current stream, and the returned ``work.wait()`` makes the *current stream*
wait for it (the CPU does not block). On CPU tensors the op completes before the call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._native import native as _native

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
    return torch._C._distributed_c10d._create_work_from_future(fut)


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
    comm_ids = _comm_ids(device)
    if previous_event is not None:
        _comm_stream(device).wait_event(previous_event)
    native = _native()
    # The comm stream becomes current (after waiting for the current stream, unless it waits for
    # previous_event instead), as in `with torch.cuda.stream(comm)`, in one C++ call.
    current_ids = native._enter_comm_stream(*comm_ids, previous_event is None)
    try:
        result = fn()
        outputs = outputs_of(result)
        fut: torch.futures.Future = torch.futures.Future(devices=[device])
        fut.set_result(outputs)  # records an event on the comm stream
    except BaseException:
        native._exit_comm_stream(current_ids, comm_ids, [], [])  # nothing to record
        raise
    # The current stream again, then ep_backend.record_stream of each: inputs stay alive until
    # the comm stream is done with them; outputs (receive-slab views too: with previous_event a
    # later dispatch's comm stream need not wait for the current stream, which may still read
    # them) for the current stream.
    native._exit_comm_stream(
        current_ids, comm_ids, [t for t in inputs if t is not None], list(outputs)
    )
    return result, torch._C._distributed_c10d._create_work_from_future(fut)
