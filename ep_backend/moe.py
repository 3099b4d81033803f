"""The MoE collectives of ``ep``: layout, dispatch, combine, and their low-latency variants.

Each function runs a ``TORCH_LIBRARY(ep)`` custom op on the group's ``"ep"`` backend (CPU tensors
through the internal Gloo exchange, CUDA tensors through our kernels), so the calls compose with
autograd and ``torch.compile``. The exact contract, with every shape and dtype, is in
``docs/semantics.md``; ``ep_backend.reference`` is its executable form and the results here equal
it bit for bit.

``async_op=True`` follows torch.distributed: the op runs on the backend's communication stream
after waiting for the current stream, and the returned ``work.wait()`` makes the *current stream*
wait for it (the CPU does not block). On CPU tensors the op completes before the call returns.

``previous_event`` (a ``torch.cuda.Event``, the high-throughput ops) is DeepEP's flag of that
name: with ``async_op=True`` the communication stream waits for that event *instead of* the
current stream, so the op need not wait for unrelated work queued there; without it the current
stream waits for the event before the op. Outputs of ``async_op=True`` are allocated on the
communication stream and recorded for the current one, as DeepEP's
``allocate_on_comm_stream=True``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ._native import native as _native
from .handles import (
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)

__all__ = [
    "FallbackWarning",
    "all_to_all_moe_dispatch",
    "combine",
    "dispatch",
    "get_dispatch_layout",
    "get_low_latency_combine_buffer",
    "low_latency_combine",
    "low_latency_dispatch",
    "record_stream",
    "reserve",
]

Group = dist.ProcessGroup | None
_ops = torch.ops.ep
# The overloads themselves: calling the packet (torch.ops.ep.dispatch) resolves the overload
# on every call, several µs of host time on a slow host (scripts/host_overhead_probe.py).
_dispatch_op = torch.ops.ep.dispatch.default
_cached_dispatch_op = torch.ops.ep.cached_dispatch.default
_combine_op = torch.ops.ep.combine.default
_layout_op = torch.ops.ep.dispatch_layout.default

# Groups already seen to have backend "ep" (a group's backend never changes), each with the
# transports ("high_throughput", "low_latency") whose choice for CUDA tensors is yet to be checked
# for a fallback to ATen. Weak keys: a destroyed group's entry goes with it; a call on a destroyed
# group still held fails in the op, which resolves the group by name.
_ep_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, set[str]] = weakref.WeakKeyDictionary()


def _group_state(group: Group) -> tuple[dist.ProcessGroup, set[str]]:
    """The ``"ep"`` group (default WORLD) and its transports still to check (``_check_fallback``)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("ep: torch.distributed is not initialized; call init_process_group")
    pending = _ep_groups.get(pg)
    if pending is not None:
        return pg, pending
    backend = dist.get_backend(pg)
    if backend != "ep":
        raise ValueError(f"ep: the MoE collectives need a group with backend 'ep', got {backend!r}")
    pending = _ep_groups[pg] = {"high_throughput", "low_latency"}
    return pg, pending


def _group(group: Group) -> dist.ProcessGroup:
    return _group_state(group)[0]


class FallbackWarning(UserWarning):
    """A group's MoE ops on CUDA tensors run on ATen + NCCL, not on ep's kernels (said once)."""


_FALLBACK_COST = {
    "high_throughput": "the NVLink kernels",
    "low_latency": "the NVSHMEM kernels (the ATen path is correct, but neither low-latency nor "
    "CUDA-graph capturable)",
}


def _check_fallback(pg: dist.ProcessGroup, pending: set[str], kind: str, on_cuda: bool) -> None:
    """Warns once per group if its ``kind`` ops on CUDA tensors fell back to ATen.

    The op decides the transport (collectively) at the group's first call on CUDA tensors; this
    reads its verdict once, after that call. No warning where the fallback was asked for
    (``EP_HIGH_THROUGHPUT=aten`` / ``EP_LOW_LATENCY=aten``). ``pending``: from ``_group_state``.
    """
    if not on_cuda or kind not in pending:
        return
    if torch.compiler.is_compiling():
        return
    from . import get_backend  # the package imports this module first

    choice = getattr(get_backend(pg), f"{kind}_transport_choice")
    if choice.kind.name == "undecided":
        return
    pending.discard(kind)
    why: str = choice.reason
    if choice.kind.name != "aten" or choice.requested:
        return
    import warnings

    warnings.warn(
        f"ep: the {kind.replace('_', '-')} MoE ops of group {pg.group_name!r} run on ATen + "
        f"NCCL, not on {_FALLBACK_COST[kind]}: {why}. (EPProcessGroup.{kind}_transport; "
        f"EP_{kind.upper()}=aten asks for this without a warning.)",
        FallbackWarning,
        stacklevel=3,
    )


def _reject(pg: dist.ProcessGroup, op: str, exc: Exception) -> NoReturn:
    """Raises ``exc`` on this rank after the agreement step of ``op``, so that no peer waits.

    Every argument check of this module that can fail on one rank only goes through here: the
    peers, already in the C++ op's agreement step, raise "rank(s) ... rejected their inputs"
    instead of waiting for this rank until the group times out.
    """
    try:
        _ops.reject(op, f"{exc}", pg.group_name)
    except RuntimeError:
        pass  # the expected outcome: the agreement step raised on every rank
    raise exc


def _require_tensor(value: Any, name: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")


def _require_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _split_x(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], x_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accepts DeepEP's ``(x_fp8, scales)`` tuple as well as ``x`` plus ``x_scales=``."""
    if isinstance(x, tuple):
        if len(x) != 2 or x_scales is not None:
            raise TypeError("pass FP8 input either as (x, scales) or as x with x_scales=")
        return x[0], x[1]
    return x, x_scales


def _opt(t: torch.Tensor, present: bool) -> torch.Tensor | None:
    return t if present else None


# --------------------------------------------------------------------------------------------
# async_op: run on the backend's communication stream, hand back a Work
# --------------------------------------------------------------------------------------------

_comm_streams: dict[int, torch.cuda.Stream] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _comm_streams:
        _comm_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _comm_streams[index]


def _needs_grad(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether autograd must record the op (else the op runs without the Function's overhead)."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(t is not None and t.requires_grad for t in others)


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
        if previous_event is not None:
            torch.cuda.current_stream(device).wait_event(previous_event)
        return fn(), None
    if device.type != "cuda":
        result = fn()
        return result, _completed_work(outputs_of(result))
    current = torch.cuda.current_stream(device)
    comm = _comm_stream(device)
    if previous_event is not None:
        comm.wait_event(previous_event)
    else:
        comm.wait_stream(current)
    with torch.cuda.stream(comm):
        result = fn()
        outputs = outputs_of(result)
        fut: torch.futures.Future = torch.futures.Future(devices=[device])
        fut.set_result(outputs)  # records an event on the comm stream
    # ep_backend.record_stream of each: inputs stay alive until the comm stream is done with
    # them; outputs (receive-slab views too: with previous_event a later dispatch's comm stream
    # need not wait for the current stream, which may still read them) for the current stream.
    record = _native()._record_streams
    record(
        [t for t in inputs if t is not None], comm.stream_id, comm.device_index, comm.device_type
    )
    record(list(outputs), current.stream_id, current.device_index, current.device_type)
    return result, torch._C._distributed_c10d._create_work_from_future(fut)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def reserve(
    num_tokens: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_scales: int | None = None,
    group: Group = None,
    device: torch.device | int | None = None,
) -> dict[str, int] | None:
    """Sizes the group's NVLink transport now for high-throughput calls up to these shapes.

    Collective: every rank of ``group`` calls it (with its own ``num_tokens``; the transport is
    sized for the largest). Without it the transport is built by the first dispatch, cached
    dispatch or combine and rebuilt, larger, by the first call that does not fit (a pause of a
    few milliseconds, after which outputs still viewing the old receive slabs keep that memory).
    Once a CUDA graph has been captured with these ops the transport never grows (the graph
    replays into its buffers): a call that would need more raises on every rank, so reserve the
    largest shapes before capturing. Reserving less than the transport already holds changes
    nothing.

    Args:
        num_tokens: the most tokens a rank passes to one call (``T``).
        hidden: ``H``, elements per row.
        num_topk: ``K`` (1..32).
        num_experts: ``E``, a multiple of the group size.
        dtype: the widest row dtype the calls move (default BF16: BF16 dispatch and combine,
            FP8 dispatch); ``torch.float32`` for float32 combines.
        num_scales: FP8 scales per row (default ``ceil(H / 128)``, DeepEP's per-128 scales).
        group: an ``"ep"`` process group (default: WORLD).
        device: the CUDA device of the calls' tensors (default: the current one).

    Returns:
        The capacity the transport holds (dict: ``num_tokens`` per rank, ``row_bytes``,
        ``num_topk``, ``num_scales``, ``num_local_experts``, ``recv_slabs``), or ``None`` where
        the group does not run the NVLink kernels (no CUDA device or build, ranks on several
        hosts, more than 8 ranks).

    Raises:
        TypeError: on a rank that passed an argument of the wrong type (its peers raise
            RuntimeError "rank(s) r rejected their inputs").
        RuntimeError: on a rank that passed an invalid size (its peers: "rejected their
            inputs"); on every rank when growing the transport would free buffers a captured
            CUDA graph uses, or for a kernel error an earlier call left.
    """
    pg, pending = _group_state(group)
    try:
        for value, name in (
            (num_tokens, "num_tokens"),
            (hidden, "hidden"),
            (num_topk, "num_topk"),
            (num_experts, "num_experts"),
        ):
            _require_int(value, name)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if num_scales is None:
            num_scales = -(-hidden // 128)
        _require_int(num_scales, "num_scales")
        if device is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else -1
        else:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            index = (
                -1
                if dev.type != "cuda"
                else (dev.index if dev.index is not None else torch.cuda.current_device())
            )
    except (TypeError, ValueError, RuntimeError) as exc:
        _reject(pg, "reserve", type(exc)(f"ep reserve: {exc}"))
    from . import get_backend

    held = get_backend(pg)._reserve(
        index, num_tokens, hidden * dtype.itemsize, num_topk, num_scales, num_experts
    )
    _check_fallback(pg, pending, "high_throughput", index >= 0)
    if held is None:
        return None
    keys = ("num_tokens", "row_bytes", "num_topk", "num_scales", "num_local_experts", "recv_slabs")
    return dict(zip(keys, held, strict=True))


def get_dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    group: Group = None,
    *,
    async_op: bool = False,
    previous_event: torch.cuda.Event | None = None,
) -> DispatchLayout:
    """Per-rank and per-expert token counts of a routing (local computation, no communication).

    Args:
        topk_idx: int64 or int32 ``[T, K]`` global expert ids, ``-1`` = no expert.
        num_experts: ``E``, a multiple of the group size ``R``.
        group: an ``"ep"`` process group (default: WORLD); only its size is used.
        async_op: run on the backend's communication stream and return at once with
            ``layout.work`` (DeepEP's ``async_finish``); ``layout.work.wait()`` before the
            current stream reads the layout. A dispatch given it with ``async_op=True`` runs on
            that stream after it and needs no wait.
        previous_event: a ``torch.cuda.Event`` the layout waits for (CUDA only): with
            ``async_op`` the communication stream waits for it instead of the current stream.

    Returns:
        ``DispatchLayout``: ``num_tokens_per_rank`` int32 ``[R]`` (a token counts once per
        rank), ``num_tokens_per_expert`` int32 ``[E]``, ``is_token_in_rank`` bool ``[T, R]``,
        ``send_pos`` int32 ``[T, R]``. Pass it to ``dispatch(..., layout=)`` with the same
        ``topk_idx`` to skip the layout step there.

    Raises:
        RuntimeError: on a CUDA ``topk_idx``, if an earlier call on the device found a value
            outside ``[-1, E)`` (that call counted it as ``-1``; checking at once would need a
            stream sync). A dispatch given that earlier layout raises instead, on every rank.
        TypeError / ValueError: for a non-tensor ``topk_idx``, a ``previous_event`` that is not
            a ``torch.cuda.Event`` or given with a CPU ``topk_idx`` (raised on this rank only:
            nothing is exchanged).
    """
    pg = _group(group)
    try:
        _require_tensor(topk_idx, "topk_idx")
        _check_previous_event(previous_event, topk_idx.device)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"ep get_dispatch_layout: {exc}") from None

    def run() -> tuple[torch.Tensor, ...]:
        return _layout_op(topk_idx, num_experts, pg.size())

    (per_rank, per_expert, in_rank, send_pos), work = _run(
        run, (topk_idx,), topk_idx.device, async_op, list, previous_event
    )
    source = None
    if not torch.compiler.is_compiling():
        source = (weakref.ref(topk_idx), _version_of(topk_idx), num_experts, pg.size())
    return DispatchLayout(per_rank, per_expert, in_rank, send_pos, work=work, _source=source)


def _version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter; None for inference tensors, which have none."""
    if t.is_inference():
        return None
    return t._version


def _check_layout(
    layout: Any, topk_idx: torch.Tensor, num_experts: int, pg: dist.ProcessGroup
) -> list[torch.Tensor]:
    """The tensors dispatch takes from ``layout`` (made by ``get_dispatch_layout(topk_idx)``)."""
    if not isinstance(layout, DispatchLayout):
        raise TypeError(f"layout must be a DispatchLayout, got {type(layout).__name__}")
    if layout.send_pos is None:
        raise ValueError("layout has no send_pos: compute it with get_dispatch_layout")
    if not torch.compiler.is_compiling():
        if layout._source is None:
            raise ValueError(
                "layout must come from ep_backend.get_dispatch_layout (it records the topk_idx "
                "it was computed from)"
            )
        ref, version, experts, ranks = layout._source
        if ref() is not topk_idx:
            raise ValueError(
                "layout was computed from another topk_idx tensor; pass the same tensor to "
                "get_dispatch_layout and dispatch"
            )
        if _version_of(topk_idx) != version:
            raise ValueError("topk_idx was modified in place after get_dispatch_layout")
        if experts != num_experts or ranks != pg.size():
            raise ValueError(
                f"layout was computed for num_experts={experts} on {ranks} ranks, this call has "
                f"num_experts={num_experts} on {pg.size()}"
            )
    return [
        layout.num_tokens_per_rank,
        layout.num_tokens_per_expert,
        layout.is_token_in_rank,
        layout.send_pos,
    ]


def all_to_all_moe_dispatch(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    *,
    x_scales: torch.Tensor | None = None,
    handle: DispatchHandle | None = None,
    expert_alignment: int = 1,
    num_worst_tokens: int = 0,
    layout: DispatchLayout | None = None,
    group: Group = None,
    async_op: bool = False,
    previous_event: torch.cuda.Event | None = None,
) -> DispatchOutput:
    """High-throughput dispatch: send each token once to every rank owning one of its experts.

    Args:
        x: ``[T, H]`` BF16 (or float16/32/64), or FP8 e4m3 with ``x_scales`` (also accepted as
            DeepEP's tuple ``(x_fp8, scales)``); contiguous; ``H * element_size`` a multiple of
            16 bytes.
        topk_idx: int64 or int32 ``[T, K]`` (K <= 32) global expert ids, ``-1`` = none.
        topk_weights: optional float32 ``[T, K]``.
        num_experts: ``E`` (a multiple of the group size).
        x_scales: float32 ``[T, S]`` (or int32 packed UE8M0) scales of FP8 ``x``, passed through.
        handle: a previous dispatch's handle: re-send new ``x`` with the same routing (cached
            dispatch; ``topk_idx``, ``topk_weights`` and ``num_experts`` must be None).
        expert_alignment: round each ``num_recv_tokens_per_expert`` up to a multiple of this.
        num_worst_tokens: if > 0, outputs have exactly this many rows and no host sync happens
            (padding rows: ``recv_topk_idx`` -1, weights 0); it must cover every rank's receive.
        layout: ``get_dispatch_layout(topk_idx, num_experts)`` of this very ``topk_idx``
            (unchanged since): dispatch then skips its own layout step, as DeepEP's does. The
            handle's ``is_token_in_rank`` and ``num_tokens_per_rank`` are then these tensors.
        group: an ``"ep"`` process group (default: WORLD).
        async_op: return at once with ``out.work``; ``out.work.wait()`` before using outputs.
        previous_event: a ``torch.cuda.Event`` the op waits for (CUDA only): with ``async_op``
            the communication stream waits for it instead of the current stream.

    Returns:
        ``DispatchOutput`` (see ``ep_backend.handles``): rows ordered by source rank then source
        token; ``recv_topk_idx`` holds *local* expert ids (-1 for other ranks' experts, weight 0).

    Raises:
        RuntimeError: on every rank, before any data moves, if any rank's input is invalid or the
            ranks disagree on E, H, K, dtypes or flags.
    """
    pg, pending = _group_state(group)
    op = "dispatch" if handle is None else "cached dispatch"
    try:
        x, x_scales = _split_x(x, x_scales)
        _require_tensor(x, "x")
        _require_tensor(x_scales, "x_scales", optional=True)
        _check_previous_event(previous_event, x.device)
        if handle is not None:
            if (
                topk_idx is not None
                or topk_weights is not None
                or num_experts is not None
                or layout is not None
            ):
                raise ValueError(
                    "with handle= (cached dispatch), topk_idx, topk_weights, num_experts and "
                    "layout must be None"
                )
            _check_handle(handle)
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("topk_idx and num_experts are required without a handle")
            _require_tensor(topk_idx, "topk_idx")
            _require_tensor(topk_weights, "topk_weights", optional=True)
            _require_int(num_experts, "num_experts")
            _require_int(expert_alignment, "expert_alignment")
            _require_int(num_worst_tokens, "num_worst_tokens")
            layout_tensors = (
                [] if layout is None else _check_layout(layout, topk_idx, num_experts, pg)
            )
    except (TypeError, ValueError) as exc:
        _reject(pg, op, type(exc)(f"ep {op}: {exc}"))
    if handle is not None:
        return _cached_dispatch(x, x_scales, handle, pg, async_op, previous_event)

    # The count wait of a plain eager call (no autograd, no async_op, no tensor subclass, not
    # traced) runs last, in `finish`: this function's own result objects are built while the GPU
    # runs notify, not after the counts came in (where the host's work delays the op's end).
    finish: Callable[[], list[int]] | None = None
    deferred = (
        not async_op
        and type(x) is torch.Tensor
        and x.is_cuda
        and not _needs_grad(x, topk_weights)
        and not torch.compiler.is_compiling()
    )

    def run() -> tuple[torch.Tensor, ...]:
        nonlocal finish
        args = (x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
                num_worst_tokens, pg.group_name, layout_tensors)  # fmt: skip
        if deferred:
            result, finish = _native()._dispatch_deferred(*args)
            return result
        return _DispatchFn.apply(*args) if _needs_grad(x, topk_weights) else _dispatch_op(*args)

    result, work = _run(
        run, (x, x_scales, topk_idx, topk_weights), x.device, async_op, list, previous_event
    )
    _check_fallback(pg, pending, "high_throughput", x.is_cuda)
    (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, in_rank,
     per_rank, recv_per_rank, src_idx, src_rank, per_expert_host) = result  # fmt: skip
    if layout is not None:  # the op returns these inputs empty (no aliasing outputs)
        in_rank, per_rank = layout.is_token_in_rank, layout.num_tokens_per_rank
    handle = DispatchHandle(
        num_ranks=pg.size(),
        num_experts=num_experts,
        is_token_in_rank=in_rank,
        num_tokens_per_rank=per_rank,
        num_recv_tokens_per_rank=recv_per_rank,
        recv_src_idx=src_idx,
        recv_src_rank=src_rank,
        num_worst_tokens=num_worst_tokens,
    )
    out = DispatchOutput(
        recv_x=recv_x,
        recv_x_scales=_opt(recv_scales, x_scales is not None),
        recv_topk_idx=recv_topk_idx,
        recv_topk_weights=_opt(recv_topk_weights, topk_weights is not None),
        num_recv_tokens_per_expert=per_expert,
        num_recv_tokens_per_expert_list=[],
        handle=handle,
        work=work,
    )
    # The host learnt the per-expert counts in its count wait: no device read. A deferred wait
    # runs now; it also sets the outputs' row counts (until then the worst case).
    out.num_recv_tokens_per_expert_list = (
        finish() if finish is not None else per_expert_host.tolist()
    )
    return out


dispatch = all_to_all_moe_dispatch


def _routing(handle: DispatchHandle) -> tuple[torch.Tensor, ...]:
    return (
        handle.is_token_in_rank,
        handle.num_tokens_per_rank,
        handle.num_recv_tokens_per_rank,
        handle.recv_src_idx,
        handle.recv_src_rank,
    )


def _check_handle(handle: Any) -> None:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")


def _cached_dispatch(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    handle: DispatchHandle,
    pg: dist.ProcessGroup,
    async_op: bool,
    previous_event: torch.cuda.Event | None,
) -> DispatchOutput:
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        args = (x, x_scales, *_routing(handle), pg.group_name)
        return _CachedDispatchFn.apply(*args) if _needs_grad(x) else _cached_dispatch_op(*args)

    # The handle's tensors are inputs too (the op may read them on the device).
    inputs = (x, x_scales, *_routing(handle))
    (recv_x, recv_scales), work = _run(run, inputs, x.device, async_op, list, previous_event)
    return DispatchOutput(
        recv_x=recv_x,
        recv_x_scales=_opt(recv_scales, x_scales is not None),
        recv_topk_idx=None,
        recv_topk_weights=None,
        num_recv_tokens_per_expert=None,
        handle=handle,
        work=work,
    )


def combine(
    x: torch.Tensor,
    handle: DispatchHandle,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
    *,
    group: Group = None,
    async_op: bool = False,
    previous_event: torch.cuda.Event | None = None,
) -> CombineOutput:
    """High-throughput combine: sum every dispatched row back into its source token.

    Args:
        x: ``[N, H]`` (BF16, float16/32/64) rows in the layout of the dispatch that made
            ``handle`` (``N`` = its ``recv_x`` rows; padding rows are ignored).
        handle: that dispatch's ``DispatchHandle``.
        topk_weights: optional float32 ``[N, K]``, summed back into ``combined_topk_weights``.
        bias: optional ``[T, H]`` tensor, or a tuple of up to two, added after the rows.
        group: an ``"ep"`` process group (default: WORLD).
        async_op: see the module docstring.
        previous_event: a ``torch.cuda.Event`` the op waits for (CUDA only): with ``async_op``
            the communication stream waits for it instead of the current stream.

    Returns:
        ``CombineOutput``: ``combined_x`` ``[T, H]`` of ``x.dtype``: float32 sum starting at +0.0
        over source ranks ascending, then the biases; bitwise deterministic run to run.
    """
    pg = _group(group)
    biases: list[torch.Tensor | None]
    try:
        _check_handle(handle)
        _require_tensor(x, "x")
        _require_tensor(topk_weights, "topk_weights", optional=True)
        _check_previous_event(previous_event, x.device)
        if bias is None:
            biases = [None, None]
        elif isinstance(bias, torch.Tensor):
            biases = [bias, None]
        else:
            biases = [b for b in bias if b is not None]
            if len(biases) > 2:
                raise ValueError(f"at most two bias tensors, got {len(biases)}")
            for b in biases:
                _require_tensor(b, "bias")
            biases += [None] * (2 - len(biases))
    except (TypeError, ValueError) as exc:
        _reject(pg, "combine", type(exc)(f"ep combine: {exc}"))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        args = (x, topk_weights, biases[0], biases[1], *_routing(handle), pg.group_name)
        if _needs_grad(x, topk_weights, *biases):
            return _CombineFn.apply(*args)
        return _combine_op(*args)

    inputs = (x, topk_weights, *biases, *_routing(handle))  # the handle's too, as for x
    (combined, weights), work = _run(run, inputs, x.device, async_op, list, previous_event)
    return CombineOutput(
        combined_x=combined,
        combined_topk_weights=_opt(weights, topk_weights is not None),
        work=work,
    )


def low_latency_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    *,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    return_recv_hook: bool = False,
    group: Group = None,
    async_op: bool = False,
) -> LowLatencyDispatchOutput:
    """Low-latency dispatch (decode): one row per (token, expert) into a padded per-expert layout.

    Args:
        x: BF16 ``[T, H]`` with ``T <= num_max_dispatch_tokens_per_rank`` and ``H % 128 == 0``.
        topk_idx: int64 or int32 ``[T, K]`` global expert ids, ``-1`` = none.
        num_max_dispatch_tokens_per_rank: ``M``, the same on every rank.
        num_experts: ``E``, a multiple of the group size.
        use_fp8: quantise to FP8 e4m3 with per-128-channel scales on the sender.
        round_scale: round the scales up to powers of two.
        use_ue8m0: pack the scales as UE8M0 bytes (needs ``round_scale`` and ``H % 512 == 0``).
        cumulative_local_expert_recv_stats: optional int32 ``[E_loc]``, incremented in place by
            the received counts.
        return_recv_hook: send now and return at once with ``out.hook``; the outputs (and
            ``cumulative_local_expert_recv_stats``) are valid once ``out.hook()`` has run on the
            current stream (every rank must call it, once; at most two dispatches may await
            their hook). Where the exchange runs on ATen (CPU groups, CUDA without the NVSHMEM
            kernels) it is complete already and the hook only updates the stats.
        group: an ``"ep"`` process group (default: WORLD).
        async_op: see the module docstring.

    Returns:
        ``LowLatencyDispatchOutput``: ``recv_x`` ``[E_loc, R*M, H]``, scales, ``recv_count``
        int32 ``[E_loc]`` and the handle for ``low_latency_combine``. Only the first
        ``recv_count[le]`` slots of expert ``le`` hold rows; the rest are unspecified (zero on the
        reference path, left unwritten by the NVSHMEM kernels, as in DeepEP).
    """
    pg, pending = _group_state(group)
    stats = cumulative_local_expert_recv_stats
    try:
        if async_op and return_recv_hook:
            raise ValueError("async_op and return_recv_hook exclude each other")
        _require_tensor(x, "x")
        _require_tensor(topk_idx, "topk_idx")
        _require_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        _require_int(num_experts, "num_experts")
        _require_tensor(stats, "cumulative_local_expert_recv_stats", optional=True)
        # Checked before the exchange: raising after it on one rank would desynchronise the
        # ranks. (An invalid num_experts is left to the op's own check.)
        if stats is not None and num_experts > 0 and num_experts % pg.size() == 0:
            experts_per_rank = num_experts // pg.size()
            if stats.dtype != torch.int32 or tuple(stats.shape) != (experts_per_rank,):
                raise ValueError(
                    "cumulative_local_expert_recv_stats must be int32 "
                    f"[E_loc={experts_per_rank}], got {stats.dtype} {tuple(stats.shape)}"
                )
    except (TypeError, ValueError) as exc:
        _reject(pg, "low_latency_dispatch", type(exc)(f"ep low_latency_dispatch: {exc}"))

    def run() -> tuple[torch.Tensor, ...]:
        outs = _ops.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
            use_ue8m0, pg.group_name, return_recv_hook,
        )  # fmt: skip
        if stats is not None and not return_recv_hook:  # on the op's stream (comm with async_op)
            stats.add_(outs[2].to(stats.device))
        return outs

    result, work = _run(run, (x, topk_idx), x.device, async_op, list)
    _check_fallback(pg, pending, "low_latency", x.is_cuda)
    recv_x, recv_scales, recv_count, src_info, layout_range = result
    handle = LowLatencyHandle(
        src_info=src_info,
        layout_range=layout_range,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        hidden=x.shape[1],
        num_experts=num_experts,
        num_ranks=pg.size(),
    )
    hook = None
    if return_recv_hook:
        from . import get_backend  # the package imports this module first

        backend = get_backend(pg)

        def hook() -> None:
            """Receives this dispatch's rows (every rank must call it once, on any stream)."""
            backend._low_latency_receive(layout_range)
            if stats is not None:
                stats.add_(recv_count.to(stats.device))

    return LowLatencyDispatchOutput(
        recv_x=recv_x,
        recv_x_scales=recv_scales if use_fp8 else None,
        recv_count=recv_count,
        handle=handle,
        hook=hook,
        work=work,
    )


def low_latency_combine(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: LowLatencyHandle,
    *,
    out: torch.Tensor | None = None,
    group: Group = None,
    async_op: bool = False,
) -> torch.Tensor:
    """Low-latency combine: ``out[t] = sum_k w[t,k] * y(t, expert_k)`` (-1 skipped), float32.

    The ATen path adds in ``k`` order, bit for bit the reference. The NVSHMEM kernels add the
    same products per expert rank first (``k`` order), then the ranks: within float32-accumulation
    tolerance of the reference and deterministic run to run (docs/semantics.md).

    Args:
        x: BF16 ``[E_loc, R*M, H]`` expert outputs in the layout of the dispatch.
        topk_idx: the ``[T, K]`` ids given to that dispatch on this rank.
        topk_weights: float32 ``[T, K]``.
        handle: that dispatch's ``LowLatencyHandle``.
        out: optional BF16 ``[T, H]`` output.
        group: an ``"ep"`` process group (default: WORLD).
        async_op: see the module docstring. A tensor has no ``work`` field: the ``Work`` is
            attached to the returned tensor as its attribute ``work``; call
            ``result.work.wait()`` before using it.

    Returns:
        BF16 ``[T, H]`` (``out`` when given).
    """
    pg = _group(group)
    try:
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
        _require_tensor(x, "x")
        _require_tensor(topk_idx, "topk_idx")
        _require_tensor(topk_weights, "topk_weights")
        _require_tensor(out, "out", optional=True)
        if out is not None:
            expected = (topk_idx.shape[0], handle.hidden) if topk_idx.dim() >= 1 else None
            if out.dtype != torch.bfloat16 or tuple(out.shape) != expected:
                raise ValueError(
                    f"out must be BF16 {list(expected or ())}, got {out.dtype} {list(out.shape)}"
                )
    except (TypeError, ValueError) as exc:
        _reject(pg, "low_latency_combine", type(exc)(f"ep low_latency_combine: {exc}"))

    def run() -> torch.Tensor:
        result = _ops.low_latency_combine(
            x, topk_idx, topk_weights, handle.src_info, handle.layout_range,
            handle.num_max_dispatch_tokens_per_rank, pg.group_name,
        )  # fmt: skip
        if out is not None:  # on the stream of the op (the comm stream with async_op)
            out.copy_(result)
            return out
        return result

    result, work = _run(run, (x, topk_idx, topk_weights), x.device, async_op, lambda r: [r])
    if work is not None:
        result.work = work
    return result


def get_low_latency_combine_buffer(handle: LowLatencyHandle, group: Group = None) -> torch.Tensor:
    """Where to write expert outputs for a zero-copy ``low_latency_combine``.

    Returns a BF16 ``[E_loc, R*M, H]`` tensor. With the NVSHMEM kernels it is a view of the send
    buffer of ``handle``'s dispatch: write the expert outputs into it and pass it as ``x`` to
    ``low_latency_combine`` with the same handle, and combine skips copying them in. Elsewhere
    it is a fresh tensor (combine then works as usual). The view stays valid until the group's
    low-latency transport is rebuilt (a call with another ``M``, or a larger ``H``, top-k or
    ``E``); do not keep it across such calls.
    """
    pg = _group(group)
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
    from . import get_backend  # the package imports this module first

    return get_backend(pg)._low_latency_combine_buffer(
        handle.layout_range, handle.num_max_dispatch_tokens_per_rank, handle.num_experts,
        handle.hidden,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Autograd: dispatch and combine are each other's adjoints
# --------------------------------------------------------------------------------------------


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, x_scales, topk_idx, topk_weights, num_experts, alignment, worst, group_name, layout
    ):  # type: ignore[override]
        outs = _dispatch_op(
            x, x_scales, topk_idx, topk_weights, num_experts, alignment, worst, group_name, layout
        )
        recv_topk_idx = outs[2]
        routing = outs[5:10]  # (outs[10]: the per-expert counts on the host)
        if layout:  # is_token_in_rank and num_tokens_per_rank are the layout's (see dispatch)
            routing = (layout[2], layout[0], *routing[2:])
        ctx.save_for_backward(recv_topk_idx, *routing)
        ctx.group_name = group_name
        ctx.has_weights = topk_weights is not None
        ctx.mark_non_differentiable(*outs[1:3], *outs[4:])
        return outs

    @staticmethod
    def backward(ctx, grad_x, _gs, _gi, grad_w, *_rest):  # type: ignore[override]
        recv_topk_idx, *routing = ctx.saved_tensors
        if grad_x is None:
            grad_x = torch.zeros((routing[3].shape[0], 0))  # unreachable in practice
        weights = None
        if ctx.has_weights:
            if grad_w is None:
                grad_w = torch.zeros(recv_topk_idx.shape, dtype=torch.float32, device=grad_x.device)
            # Weights of other ranks' experts were constants (0): no gradient flows to them.
            weights = torch.where(recv_topk_idx >= 0, grad_w, 0.0).contiguous()
        gx, gw = _combine_op(grad_x.contiguous(), weights, None, None, *routing, ctx.group_name)
        return gx, None, None, (gw if ctx.has_weights else None), None, None, None, None, None


class _CachedDispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_scales, in_rank, per_rank, recv_per_rank, src_idx, src_rank, group_name):  # type: ignore[override]
        outs = _cached_dispatch_op(
            x, x_scales, in_rank, per_rank, recv_per_rank, src_idx, src_rank, group_name
        )
        ctx.save_for_backward(in_rank, per_rank, recv_per_rank, src_idx, src_rank)
        ctx.group_name = group_name
        ctx.mark_non_differentiable(outs[1])
        return outs

    @staticmethod
    def backward(ctx, grad_x, _gs):  # type: ignore[override]
        routing = ctx.saved_tensors
        gx, _ = _combine_op(grad_x.contiguous(), None, None, None, *routing, ctx.group_name)
        return gx, None, None, None, None, None, None, None


def _pad_columns(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[1]) % multiple
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        topk_weights,
        bias0,
        bias1,
        in_rank,
        per_rank,
        recv_per_rank,
        src_idx,
        src_rank,
        group_name,
    ):  # type: ignore[override]
        combined, weights = _combine_op(
            x, topk_weights, bias0, bias1, in_rank, per_rank, recv_per_rank, src_idx, src_rank,
            group_name,
        )  # fmt: skip
        ctx.save_for_backward(in_rank, per_rank, recv_per_rank, src_idx, src_rank)
        ctx.group_name = group_name
        ctx.has_weights = topk_weights is not None
        ctx.num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        ctx.has_bias = (bias0 is not None, bias1 is not None)
        return combined, weights

    @staticmethod
    def backward(ctx, grad_combined, grad_weights):  # type: ignore[override]
        routing = ctx.saved_tensors
        # Dispatched rows must be multiples of 16 bytes; combine accepts any H, so pad and slice.
        hidden = grad_combined.shape[1]
        padded_grad = _pad_columns(grad_combined.contiguous(), 16 // grad_combined.element_size())
        gx, _ = _cached_dispatch_op(padded_grad, None, *routing, ctx.group_name)
        gx = gx[:, :hidden].contiguous() if gx.shape[1] != hidden else gx
        gw = None
        if ctx.has_weights:
            if grad_weights is None:
                grad_weights = torch.zeros(
                    (routing[0].shape[0], ctx.num_topk), dtype=torch.float32,
                    device=grad_combined.device,
                )  # fmt: skip
            # Rows must be multiples of 16 bytes: pad K float32 columns to a multiple of 4.
            padded = _pad_columns(grad_weights.contiguous(), 4)
            gw, _ = _cached_dispatch_op(padded, None, *routing, ctx.group_name)
            gw = gw[:, : ctx.num_topk].contiguous()
        g0 = grad_combined if ctx.has_bias[0] else None
        g1 = grad_combined if ctx.has_bias[1] else None
        return gx, gw, g0, g1, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Fake (meta) kernels, for torch.compile
# --------------------------------------------------------------------------------------------


def _group_size(group_name: str) -> int:
    return torch.distributed.distributed_c10d._resolve_process_group(group_name).size()


@torch.library.register_fake("ep::dispatch_layout")
def _dispatch_layout_fake(topk_idx, num_experts, num_ranks):
    num_tokens = topk_idx.shape[0]
    return (
        topk_idx.new_empty((num_ranks,), dtype=torch.int32),
        topk_idx.new_empty((num_experts,), dtype=torch.int32),
        topk_idx.new_empty((num_tokens, num_ranks), dtype=torch.bool),
        topk_idx.new_empty((num_tokens, num_ranks), dtype=torch.int32),
    )


@torch.library.register_fake("ep::dispatch")
def _dispatch_fake(
    x, x_scales, topk_idx, topk_weights, num_experts, alignment, worst, group_name, layout
):
    num_ranks = _group_size(group_name)
    rows = worst if worst > 0 else torch.library.get_ctx().new_dynamic_size()
    num_tokens, topk = topk_idx.shape
    empty = x.new_empty((0,))
    return (
        x.new_empty((rows, x.shape[1])),
        x_scales.new_empty((rows, x_scales.shape[1])) if x_scales is not None else empty,
        topk_idx.new_empty((rows, topk)),
        x.new_empty((rows, topk), dtype=torch.float32) if topk_weights is not None else empty,
        x.new_empty((num_experts // num_ranks,), dtype=torch.int32),
        x.new_empty((0 if layout else num_tokens, num_ranks), dtype=torch.bool),
        x.new_empty((0 if layout else num_ranks,), dtype=torch.int32),
        x.new_empty((num_ranks,), dtype=torch.int32),
        x.new_empty((rows,), dtype=torch.int32),
        x.new_empty((rows,), dtype=torch.int32),
        torch.empty((0 if worst > 0 else num_experts // num_ranks,), dtype=torch.int64),
    )


@torch.library.register_fake("ep::cached_dispatch")
def _cached_dispatch_fake(
    x, x_scales, in_rank, per_rank, recv_per_rank, src_idx, src_rank, group_name
):
    rows = src_idx.shape[0]
    scales = (
        x_scales.new_empty((rows, x_scales.shape[1])) if x_scales is not None else x.new_empty((0,))
    )
    return x.new_empty((rows, x.shape[1])), scales


@torch.library.register_fake("ep::combine")
def _combine_fake(
    x, topk_weights, bias0, bias1, in_rank, per_rank, recv_per_rank, src_idx, src_rank, group_name
):
    num_tokens = in_rank.shape[0]
    weights = (
        x.new_empty((num_tokens, topk_weights.shape[1]), dtype=torch.float32)
        if topk_weights is not None
        else x.new_empty((0,))
    )
    return x.new_empty((num_tokens, x.shape[1])), weights


@torch.library.register_fake("ep::low_latency_dispatch")
def _ll_dispatch_fake(
    x, topk_idx, max_tokens, num_experts, use_fp8, round_scale, use_ue8m0, group_name,
    send_only=False,
):  # fmt: skip
    num_ranks = _group_size(group_name)
    experts_per_rank = num_experts // num_ranks
    slots = num_ranks * max_tokens
    hidden = x.shape[1]
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    if use_fp8 and use_ue8m0:
        scales = x.new_empty((experts_per_rank, slots, hidden // 512), dtype=torch.int32)
    elif use_fp8:
        scales = x.new_empty((experts_per_rank, slots, hidden // 128), dtype=torch.float32)
    else:
        scales = x.new_empty((0,))
    return (
        x.new_empty((experts_per_rank, slots, hidden), dtype=dtype),
        scales,
        x.new_empty((experts_per_rank,), dtype=torch.int32),
        x.new_empty((experts_per_rank, slots), dtype=torch.int32),
        x.new_empty((experts_per_rank, num_ranks), dtype=torch.int64),
    )


@torch.library.register_fake("ep::low_latency_combine")
def _ll_combine_fake(x, topk_idx, topk_weights, src_info, layout_range, max_tokens, group_name):
    return x.new_empty((topk_idx.shape[0], x.shape[2]))
