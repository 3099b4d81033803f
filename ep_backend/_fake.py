"""Fake (meta) kernels of the ``ep`` custom ops: output shapes and dtypes, for torch.compile.

Importing this module registers them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from ._failures import _META

Tensors = tuple[Tensor, ...]


def _refuse_meta(*tensors: Tensor | None) -> None:
    """Raises if a collective was called with real ``meta`` tensors (not torch.compile's fake
    ones, whose device is the real one): such a call would return shapes on this rank only,
    without the cross-rank agreement, and its peers would pair with this rank's next call. The
    Python wrapper turns the error into a rejection every rank sees (``_failures._failed``)."""
    for t in tensors:
        if t is not None and t.is_meta and not isinstance(t, FakeTensor):
            raise ValueError(_META)


def _group_size(group_name: str) -> int:
    # (torch 2.13+ types the name as GroupName, a str at run time)
    resolve = torch.distributed.distributed_c10d._resolve_process_group
    return resolve(group_name).size()  # type: ignore[arg-type]


@torch.library.register_fake("ep::dispatch_layout")
def _dispatch_layout_fake(topk_idx: Tensor, num_experts: int, num_ranks: int) -> Tensors:
    num_tokens = topk_idx.shape[0]
    return (
        topk_idx.new_empty((num_ranks,), dtype=torch.int32),
        topk_idx.new_empty((num_experts,), dtype=torch.int32),
        topk_idx.new_empty((num_tokens, num_ranks), dtype=torch.bool),
        topk_idx.new_empty((num_tokens, num_ranks), dtype=torch.int32),
    )


@torch.library.register_fake("ep::dispatch")
def _dispatch_fake(
    x: Tensor, x_scales: Tensor | None, topk_idx: Tensor, topk_weights: Tensor | None,
    num_experts: int, alignment: int, worst: int, group_name: str, layout: list[Tensor],
) -> Tensors:  # fmt: skip
    _refuse_meta(x, x_scales, topk_idx, topk_weights, *layout)
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
    x: Tensor, x_scales: Tensor | None, in_rank: Tensor, per_rank: Tensor,
    recv_per_rank: Tensor, src_idx: Tensor, src_rank: Tensor, group_name: str,
) -> Tensors:  # fmt: skip
    _refuse_meta(x, x_scales, in_rank, per_rank, recv_per_rank, src_idx, src_rank)
    rows = src_idx.shape[0]
    scales = (
        x_scales.new_empty((rows, x_scales.shape[1])) if x_scales is not None else x.new_empty((0,))
    )
    return x.new_empty((rows, x.shape[1])), scales


@torch.library.register_fake("ep::combine")
def _combine_fake(
    x: Tensor, topk_weights: Tensor | None, bias0: Tensor | None, bias1: Tensor | None,
    in_rank: Tensor, per_rank: Tensor, recv_per_rank: Tensor, src_idx: Tensor, src_rank: Tensor,
    group_name: str,
) -> Tensors:  # fmt: skip
    _refuse_meta(x, topk_weights, bias0, bias1, in_rank, per_rank, recv_per_rank, src_idx, src_rank)
    num_tokens = in_rank.shape[0]
    weights = (
        x.new_empty((num_tokens, topk_weights.shape[1]), dtype=torch.float32)
        if topk_weights is not None
        else x.new_empty((0,))
    )
    return x.new_empty((num_tokens, x.shape[1])), weights


@torch.library.register_fake("ep::low_latency_dispatch")
def _ll_dispatch_fake(
    x: Tensor, topk_idx: Tensor, max_tokens: int, num_experts: int, use_fp8: bool,
    round_scale: bool, use_ue8m0: bool, group_name: str, send_only: bool = False,
) -> Tensors:  # fmt: skip
    _refuse_meta(x, topk_idx)
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
def _ll_combine_fake(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, src_info: Tensor, layout_range: Tensor,
    max_tokens: int, group_name: str,
) -> Tensor:  # fmt: skip
    _refuse_meta(x, topk_idx, topk_weights, src_info, layout_range)
    return x.new_empty((topk_idx.shape[0], x.shape[2]))
