"""The high-throughput MoE collectives of ``ep``: layout, dispatch, combine, and ``reserve``.

Each function runs a ``TORCH_LIBRARY(ep)`` custom op on the group's ``"ep"`` backend (CPU tensors
through the internal Gloo exchange, CUDA tensors through our kernels), so the calls compose with
autograd and ``torch.compile``. The exact contract, with every shape and dtype, is in
``docs/semantics.md``; ``ep_backend.reference`` is its executable form and the results here equal
it bit for bit. The low-latency variants are in ``ep_backend.low_latency``.

``async_op=True`` follows torch.distributed: the op runs on the backend's communication stream
after waiting for the current stream, and the returned ``work.wait()`` makes the *current stream*
wait for it (the CPU does not block). On CPU tensors the op completes before the call returns.

``previous_event`` (a ``torch.cuda.Event``) is DeepEP's flag of that name: with
``async_op=True`` the communication stream waits for that event *instead of* the current
stream, so the op need not wait for unrelated work queued there; without it the current stream
waits for the event before the op. Outputs of ``async_op=True`` are allocated on the
communication stream and recorded for the current one, as DeepEP's
``allocate_on_comm_stream=True``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._arguments import _require_int, _require_tensor
from ._autograd import _CachedDispatchFn, _CombineFn, _DispatchFn, _needs_grad
from ._custom_ops import (
    _cached_dispatch_op,
    _combine_op,
    _dispatch_op,
    _layout_op,
    _through_torch_ops,
)
from ._failures import _failed, _input_error, _reject, _translate
from ._fallback import _check_fallback
from ._groups import Group, _group_info, _group_state, _node_of_rank, get_backend
from ._native import native as _native
from ._streams import _check_previous_event, _run
from .handles import CombineOutput, DispatchHandle, DispatchLayout, DispatchOutput

__all__ = [
    "all_to_all_moe_dispatch",
    "combine",
    "dispatch",
    "get_dispatch_layout",
    "reserve",
]


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
        _reject(pg, "reserve", exc)
    try:
        held = get_backend(pg)._reserve(
            index, num_tokens, hidden * dtype.itemsize, num_topk, num_scales, num_experts
        )
    except RuntimeError as exc:
        raise _translate("reserve", exc) from None
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
        ``send_pos`` int32 ``[T, R]``, and ``num_tokens_per_node`` int32 ``[num_nodes]``
        (computed at first read). Pass it to ``dispatch(..., layout=)`` with the same
        ``topk_idx`` to skip the layout step there.

    Raises:
        RuntimeError: on a CUDA ``topk_idx``, if an earlier call on the device found a value
            outside ``[-1, E)`` (that call counted it as ``-1``; checking at once would need a
            stream sync). A dispatch given that earlier layout raises instead, on every rank.
        TypeError / ValueError: for a non-tensor ``topk_idx``, a ``previous_event`` that is not
            a ``torch.cuda.Event`` or given with a CPU ``topk_idx`` (raised on this rank only:
            nothing is exchanged).
    """
    pg, info = _group_info(group)
    num_ranks = info.size
    try:
        _require_tensor(topk_idx, "topk_idx")
        _check_previous_event(previous_event, topk_idx.device)
    except (TypeError, ValueError) as exc:
        raise _input_error("get_dispatch_layout", exc) from None

    def run() -> tuple[torch.Tensor, ...]:
        return _layout_op(topk_idx, num_experts, num_ranks)

    try:
        (per_rank, per_expert, in_rank, send_pos), work = _run(
            run, (topk_idx,), topk_idx.device, async_op, list, previous_event
        )
    except RuntimeError as exc:  # local: nothing to agree on, only the type changes
        if not f"{exc}".startswith("ep get_dispatch_layout"):
            raise
        raise _input_error("get_dispatch_layout", exc) from None
    source = nodes = None
    if not torch.compiler.is_compiling():
        outputs = (per_rank, per_expert, in_rank, send_pos)
        source = (
            weakref.ref(topk_idx), _version_of(topk_idx), num_experts, num_ranks,
            tuple(weakref.ref(t) for t in outputs), tuple(_version_of(t) for t in outputs),
        )  # fmt: skip
        nodes = _node_of_rank(pg)
    return DispatchLayout(
        per_rank, per_expert, in_rank, send_pos, work=work, _source=source, _node_of_rank=nodes
    )


def _version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter; None for inference tensors, which have none."""
    if t.is_inference():
        return None
    return t._version


def _check_layout(
    layout: Any, topk_idx: torch.Tensor, num_experts: int, num_ranks: int
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
        ref, version, experts, ranks, output_refs, output_versions = layout._source
        if ref() is not topk_idx:
            raise ValueError(
                "layout was computed from another topk_idx tensor; pass the same tensor to "
                "get_dispatch_layout and dispatch"
            )
        if _version_of(topk_idx) != version:
            raise ValueError("topk_idx was modified in place after get_dispatch_layout")
        if experts != num_experts or ranks != num_ranks:
            raise ValueError(
                f"layout was computed for num_experts={experts} on {ranks} ranks, this call has "
                f"num_experts={num_experts} on {num_ranks}"
            )
    tensors = [
        layout.num_tokens_per_rank,
        layout.num_tokens_per_expert,
        layout.is_token_in_rank,
        layout.send_pos,
    ]
    if not torch.compiler.is_compiling():
        # On CUDA nothing compares the layout with topk_idx (that would read topk_idx back, a
        # stream sync), so its tensors must be the very ones get_dispatch_layout returned.
        for name, t, made, made_version in zip(
            _LAYOUT_FIELDS, tensors, output_refs, output_versions, strict=True
        ):
            if made() is not t:
                raise ValueError(
                    f"layout.{name} is not the tensor get_dispatch_layout returned (a layout "
                    "must be passed as computed)"
                )
            if _version_of(t) != made_version:
                raise ValueError(f"layout.{name} was modified in place after get_dispatch_layout")
    return tensors


_LAYOUT_FIELDS = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "send_pos")


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
        TypeError / ValueError: on a rank that passed an argument of the wrong type or form
            (its peers raise RuntimeError "rank(s) r rejected their inputs").
    """
    pg, info = _group_info(group)
    name = info.name
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
            _check_handle(handle, name)
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("topk_idx and num_experts are required without a handle")
            _require_tensor(topk_idx, "topk_idx")
            _require_tensor(topk_weights, "topk_weights", optional=True)
            _require_int(num_experts, "num_experts")
            _require_int(expert_alignment, "expert_alignment")
            _require_int(num_worst_tokens, "num_worst_tokens")
            layout_tensors = (
                [] if layout is None else _check_layout(layout, topk_idx, num_experts, info.size)
            )
    except (TypeError, ValueError) as exc:
        _reject(pg, op, exc)
    if handle is not None:
        return _cached_dispatch(x, x_scales, handle, pg, name, async_op, previous_event)
    assert num_experts is not None  # required without a handle (checked above)

    # The count wait of a plain eager call (no autograd, no async_op, no tensor subclass, not
    # traced) runs last, in `finish`: this function's own result objects are built while the GPU
    # runs notify, not after the counts came in (where the host's work delays the op's end).
    finish: Callable[[], list[int]] | None = None
    # It calls the C++ op itself, not through the dispatcher: only where no dispatch mode or
    # __torch_function__ override would have seen the op.
    deferred = (
        not async_op
        and type(x) is torch.Tensor
        and x.is_cuda
        and not _needs_grad(x, topk_weights)
        and not _through_torch_ops((x, x_scales, topk_idx, topk_weights))
        and torch._C._len_torch_dispatch_stack() == 0
    )

    def run() -> tuple[torch.Tensor, ...]:
        nonlocal finish
        args = (x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
                num_worst_tokens, name, layout_tensors)  # fmt: skip
        if deferred:
            result, finish = _native()._dispatch_deferred(*args)
            return result
        return _DispatchFn.apply(*args) if _needs_grad(x, topk_weights) else _dispatch_op(*args)

    inputs = (x, x_scales, topk_idx, topk_weights)
    try:
        result, work = _run(run, inputs, x.device, async_op, list, previous_event)
    except Exception as exc:
        raise _failed(pg, op, exc, (*inputs, *layout_tensors)) from None
    _check_fallback(pg, info.pending, "high_throughput", x.is_cuda)
    (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, in_rank,
     per_rank, recv_per_rank, src_idx, src_rank, per_expert_host) = result  # fmt: skip
    if layout is not None:  # the op returns these inputs empty (no aliasing outputs)
        in_rank, per_rank = layout.is_token_in_rank, layout.num_tokens_per_rank
    handle = DispatchHandle(
        num_ranks=info.size,
        num_experts=num_experts,
        is_token_in_rank=in_rank,
        num_tokens_per_rank=per_rank,
        num_recv_tokens_per_rank=recv_per_rank,
        recv_src_idx=src_idx,
        recv_src_rank=src_rank,
        num_worst_tokens=num_worst_tokens,
        group_name=name,
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
    try:
        out.num_recv_tokens_per_expert_list = (
            finish() if finish is not None else per_expert_host.tolist()
        )
    except RuntimeError as exc:
        raise _translate(op, exc) from None
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


def _check_handle(handle: Any, call_group_name: str) -> None:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
    _check_handle_group(handle.group_name, call_group_name)


def _check_handle_group(group_name: str | None, call_group_name: str) -> None:
    """A handle of another group (or of one aborted and re-created since) is refused.

    ``call_group_name``: the name of the call's group (``_group_info(group)[1].name``).
    """
    if group_name is not None and group_name != call_group_name:
        raise ValueError(
            f"the handle was made on group {group_name!r}, this call is on group "
            f"{call_group_name!r} (a handle belongs to its group; after ep_backend.abort and a new "
            "group, dispatch again)"
        )


def _cached_dispatch(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    handle: DispatchHandle,
    pg: dist.ProcessGroup,
    name: str,
    async_op: bool,
    previous_event: torch.cuda.Event | None,
) -> DispatchOutput:
    def run() -> tuple[torch.Tensor, torch.Tensor]:
        args = (x, x_scales, *_routing(handle), name)
        return _CachedDispatchFn.apply(*args) if _needs_grad(x) else _cached_dispatch_op(*args)

    # The handle's tensors are inputs too (the op may read them on the device).
    inputs = (x, x_scales, *_routing(handle))
    try:
        (recv_x, recv_scales), work = _run(run, inputs, x.device, async_op, list, previous_event)
    except Exception as exc:
        raise _failed(pg, "cached dispatch", exc, inputs) from None
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
        ``combined_topk_weights``: float32 ``[T, K]``, ``topk_weights`` summed back the same
        way, or ``None`` without them.

    Raises:
        RuntimeError: on every rank, before any data moves, if any rank's input is invalid or the
            ranks disagree on H, dtypes or flags.
        TypeError / ValueError: on a rank that passed an argument of the wrong type or form
            (its peers raise RuntimeError "rank(s) r rejected their inputs").
    """
    pg, info = _group_info(group)
    name = info.name
    biases: list[torch.Tensor | None]
    try:
        _check_handle(handle, name)
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
        _reject(pg, "combine", exc)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        args = (x, topk_weights, biases[0], biases[1], *_routing(handle), name)
        if _needs_grad(x, topk_weights, *biases):
            return _CombineFn.apply(*args)
        return _combine_op(*args)

    inputs = (x, topk_weights, *biases, *_routing(handle))  # the handle's too, as for x
    try:
        (combined, weights), work = _run(run, inputs, x.device, async_op, list, previous_event)
    except Exception as exc:
        raise _failed(pg, "combine", exc, inputs) from None
    return CombineOutput(
        combined_x=combined,
        combined_topk_weights=_opt(weights, topk_weights is not None),
        work=work,
    )
