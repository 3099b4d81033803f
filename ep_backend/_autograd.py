"""Autograd of the high-throughput ops: dispatch and combine are each other's adjoints."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._custom_ops import _cached_dispatch_op, _combine_op, _dispatch_op

Tensors = tuple[Tensor, ...]
Grads = tuple[Tensor | None, ...]


def _needs_grad(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether autograd must record the op (else the op runs without the Function's overhead)."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(t is not None and t.requires_grad for t in others)


def _pad_columns(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[1]) % multiple
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, x_scales: Tensor | None, topk_idx: Tensor,
        topk_weights: Tensor | None, num_experts: int, alignment: int, worst: int,
        group_name: str, layout: list[Tensor],
    ) -> Tensors:  # fmt: skip
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
    def backward(  # type: ignore[override]
        ctx: Any, grad_x: Tensor | None, _gs: Tensor | None, _gi: Tensor | None,
        grad_w: Tensor | None, *_rest: Tensor | None,
    ) -> Grads:  # fmt: skip
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
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, x_scales: Tensor | None, in_rank: Tensor, per_rank: Tensor,
        recv_per_rank: Tensor, src_idx: Tensor, src_rank: Tensor, group_name: str,
    ) -> Tensors:  # fmt: skip
        outs = _cached_dispatch_op(
            x, x_scales, in_rank, per_rank, recv_per_rank, src_idx, src_rank, group_name
        )
        ctx.save_for_backward(in_rank, per_rank, recv_per_rank, src_idx, src_rank)
        ctx.group_name = group_name
        ctx.mark_non_differentiable(outs[1])
        return outs

    @staticmethod
    def backward(ctx: Any, grad_x: Tensor, _gs: Tensor | None) -> Grads:  # type: ignore[override]
        routing = ctx.saved_tensors
        gx, _ = _combine_op(grad_x.contiguous(), None, None, None, *routing, ctx.group_name)
        return gx, None, None, None, None, None, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, topk_weights: Tensor | None, bias0: Tensor | None,
        bias1: Tensor | None, in_rank: Tensor, per_rank: Tensor, recv_per_rank: Tensor,
        src_idx: Tensor, src_rank: Tensor, group_name: str,
    ) -> Tensors:  # fmt: skip
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
    def backward(  # type: ignore[override]
        ctx: Any, grad_combined: Tensor, grad_weights: Tensor | None
    ) -> Grads:
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
