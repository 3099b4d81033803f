"""The low-latency MoE collectives of ``ep`` (decode): fixed shapes, no CPU sync.

Each function runs a ``TORCH_LIBRARY(ep)`` custom op on the group's ``"ep"`` backend (CPU tensors
and CUDA tensors without the NVSHMEM kernels through ATen, CUDA tensors through the NVSHMEM
kernels otherwise). The exact contract, with every shape and dtype, is in ``docs/semantics.md``;
``ep_backend.reference`` is its executable form.

``async_op=True`` follows torch.distributed: the op runs on the backend's communication stream
after waiting for the current stream, and the returned ``work.wait()`` makes the *current stream*
wait for it (the CPU does not block). On CPU tensors the op completes before the call returns.
"""

from __future__ import annotations

import torch

from ._arguments import _require_bool, _require_int, _require_tensor
from ._custom_ops import _low_latency_combine_op, _low_latency_dispatch_op
from ._failures import _failed, _reject
from ._fallback import _check_fallback
from ._groups import Group, _backend_of, _group, _group_info, get_backend
from ._streams import _run
from .handles import LowLatencyDispatchOutput, LowLatencyHandle
from .moe import _check_handle_group

__all__ = [
    "get_low_latency_combine_buffer",
    "low_latency_combine",
    "low_latency_dispatch",
]


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

    Raises:
        RuntimeError: on every rank, before any data moves, if any rank's input is invalid or the
            ranks disagree on ``M``, ``E``, ``H`` or flags.
        TypeError / ValueError: on a rank that passed an argument of the wrong type or form
            (its peers raise RuntimeError "rank(s) r rejected their inputs").
    """
    pg, info = _group_info(group)
    stats = cumulative_local_expert_recv_stats
    try:
        if async_op and return_recv_hook:
            raise ValueError("async_op and return_recv_hook exclude each other")
        _require_tensor(x, "x")
        _require_tensor(topk_idx, "topk_idx")
        _require_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        _require_int(num_experts, "num_experts")
        _require_tensor(stats, "cumulative_local_expert_recv_stats", optional=True)
        for flag, name in ((use_fp8, "use_fp8"), (round_scale, "round_scale"),
                           (use_ue8m0, "use_ue8m0"), (return_recv_hook, "return_recv_hook")):  # fmt: skip
            _require_bool(flag, name)
        # Checked before the exchange: raising after it on one rank would desynchronise the
        # ranks. (An invalid num_experts is left to the op's own check.)
        if stats is not None and stats.device != x.device and stats.device.type != "cpu":
            raise ValueError(
                "cumulative_local_expert_recv_stats must be on x's device or the CPU, got "
                f"{stats.device}"
            )
        if stats is not None and num_experts > 0 and num_experts % info.size == 0:
            experts_per_rank = num_experts // info.size
            if stats.dtype != torch.int32 or tuple(stats.shape) != (experts_per_rank,):
                raise ValueError(
                    "cumulative_local_expert_recv_stats must be int32 "
                    f"[E_loc={experts_per_rank}], got {stats.dtype} {tuple(stats.shape)}"
                )
    except (TypeError, ValueError) as exc:
        _reject(pg, "low_latency_dispatch", exc)

    def run() -> tuple[torch.Tensor, ...]:
        outs = _low_latency_dispatch_op(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
            use_ue8m0, info.name, return_recv_hook,
        )  # fmt: skip
        if stats is not None and not return_recv_hook:  # on the op's stream (comm with async_op)
            stats.add_(outs[2].to(stats.device))
        return outs

    try:
        result, work = _run(run, (x, topk_idx), x.device, async_op, list)
    except Exception as exc:
        raise _failed(pg, "low_latency_dispatch", exc, (x, topk_idx, stats)) from None
    _check_fallback(pg, info.pending, "low_latency", x.is_cuda)
    recv_x, recv_scales, recv_count, src_info, layout_range = result
    handle = LowLatencyHandle(
        src_info=src_info,
        layout_range=layout_range,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        hidden=x.shape[1],
        num_experts=num_experts,
        num_ranks=info.size,
        group_name=info.name,
    )
    hook = None
    if return_recv_hook:
        backend = _backend_of(pg, info)

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
        topk_idx: the int64 or int32 ``[T, K]`` ids given to that dispatch on this rank.
        topk_weights: float32 ``[T, K]``.
        handle: that dispatch's ``LowLatencyHandle``.
        out: optional BF16 ``[T, H]`` output.
        group: an ``"ep"`` process group (default: WORLD).
        async_op: see the module docstring. A tensor has no ``work`` field: the ``Work`` is
            attached to the returned tensor as its attribute ``work``; call
            ``result.work.wait()`` before using it.

    Returns:
        BF16 ``[T, H]`` (``out`` when given).

    Raises:
        RuntimeError: on every rank, before any data moves, if any rank's input is invalid or the
            ranks disagree on ``M`` or ``H``.
        TypeError / ValueError: on a rank that passed an argument of the wrong type or form
            (its peers raise RuntimeError "rank(s) r rejected their inputs").
    """
    pg, info = _group_info(group)
    try:
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
        _check_handle_group(handle.group_name, info.name)
        _require_tensor(x, "x")
        _require_tensor(topk_idx, "topk_idx")
        _require_tensor(topk_weights, "topk_weights")
        _require_tensor(out, "out", optional=True)
        if out is not None:
            if out.device != x.device:
                raise ValueError(f"out must be on x's device {x.device}, got {out.device}")
            expected = (topk_idx.shape[0], handle.hidden) if topk_idx.dim() >= 1 else None
            if out.dtype != torch.bfloat16 or tuple(out.shape) != expected:
                raise ValueError(
                    f"out must be BF16 {list(expected or ())}, got {out.dtype} {list(out.shape)}"
                )
    except (TypeError, ValueError) as exc:
        _reject(pg, "low_latency_combine", exc)

    def run() -> torch.Tensor:
        result = _low_latency_combine_op(
            x, topk_idx, topk_weights, handle.src_info, handle.layout_range,
            handle.num_max_dispatch_tokens_per_rank, info.name,
        )  # fmt: skip
        if out is not None:  # on the stream of the op (the comm stream with async_op)
            out.copy_(result)
            return out
        return result

    try:
        result, work = _run(run, (x, topk_idx, topk_weights), x.device, async_op, lambda r: [r])
    except Exception as exc:
        inputs = (x, topk_idx, topk_weights, handle.src_info, handle.layout_range)
        raise _failed(pg, "low_latency_combine", exc, inputs) from None
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

    Args:
        handle: the ``LowLatencyHandle`` of the dispatch whose rows the experts processed.
        group: an ``"ep"`` process group (default: WORLD).

    Raises:
        TypeError: if ``handle`` is not a ``LowLatencyHandle`` (on this rank only: nothing is
            exchanged).
    """
    pg = _group(group)
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
    return get_backend(pg)._low_latency_combine_buffer(
        handle.layout_range, handle.num_max_dispatch_tokens_per_rank, handle.num_experts,
        handle.hidden,
    )  # fmt: skip
