"""Malformed MoE calls raise on every rank, quickly, and leave the group usable.

Each case gives a bad argument on rank 1 only (where that makes sense; the others get valid
ones) or makes the ranks disagree. Every rank must raise: the faulty rank with the specific
message (the type of a Python-level check, e.g. ``TypeError``, or ``RuntimeError`` from the op),
its peers with "rank(s) 1 rejected their inputs" (or, for a disagreement, every rank with the
disagreement message). No rank may wait for another: each case must end within seconds and the
whole run is bounded by ``TIMEOUT``. After every case a valid dispatch + combine, in the same
processes, must still equal the reference bit for bit.

All cases of one world size run in one worker run (starting processes costs seconds); the
parametrized tests then check the recorded outcome of their case.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed
from moe_helpers import (
    BF16,
    FP8,
    Mismatches,
    compare_combine,
    compare_dispatch,
    scale_rows,
    single_thread,
)

TIMEOUT = 60.0  # the whole run of ~70 cases; a hang anywhere fails the tests at this point
CASE_SECONDS = 10.0  # each case must end (on every rank) well within this
STUCK_CASE_SECONDS = 20.0  # a case still running after this dumps its stacks
WORLDS = (2, 4)
NUM_TOKENS = 5
HIDDEN = 64
TOPK = 2
LL_MAX_TOKENS = 6
LL_HIDDEN = 128
CPU = torch.device("cpu")


@dataclass
class Ctx:
    """What a case needs on one rank: valid inputs and handles made by valid calls."""

    rank: int
    world: int
    ep: Any
    num_experts: int
    x: torch.Tensor
    idx: torch.Tensor
    weights: torch.Tensor
    out: Any  # a valid DispatchOutput of (x, idx, weights)
    all_to_rank0: Any  # a valid DispatchOutput of the same x, every token to rank 0 only
    other_group_out: Any  # a valid DispatchOutput on a subgroup of another size
    ll_x: torch.Tensor
    ll_out: Any  # a valid LowLatencyDispatchOutput of (ll_x, idx)
    device: torch.device  # of every tensor above (the cases make theirs there too)

    @property
    def bad(self) -> bool:
        return self.rank == 1

    def pick(self, good: Any, bad: Any) -> Any:
        """``bad`` on rank 1, ``good`` elsewhere."""
        return bad if self.bad else good

    def dispatch(self, **overrides: Any) -> Any:
        kwargs = {
            "x": self.x,
            "topk_idx": self.idx,
            "topk_weights": self.weights,
            "num_experts": self.num_experts,
        }
        kwargs.update(overrides)
        return self.ep.dispatch(**kwargs)

    def combine(self, **overrides: Any) -> Any:
        kwargs = {"x": scale_rows(self.out.recv_x, 2.0), "handle": self.out.handle}
        kwargs.update(overrides)
        return self.ep.combine(**kwargs)

    def ll_dispatch(self, **overrides: Any) -> Any:
        kwargs = {
            "x": self.ll_x,
            "topk_idx": self.idx,
            "num_max_dispatch_tokens_per_rank": LL_MAX_TOKENS,
            "num_experts": self.num_experts,
            "use_fp8": False,
        }
        kwargs.update(overrides)
        return self.ep.low_latency_dispatch(**kwargs)

    def ll_combine(self, **overrides: Any) -> Any:
        kwargs = {
            "x": self.ll_out.recv_x,
            "topk_idx": self.idx,
            "topk_weights": self.weights,
            "handle": self.ll_out.handle,
        }
        kwargs.update(overrides)
        return self.ep.low_latency_combine(**kwargs)


REJECTED = r"rank\(s\) 1 rejected their inputs"


@dataclass(frozen=True)
class Case:
    """A malformed call. ``everywhere``: every rank raises ``message`` (disagreements and
    checks that see all ranks' counts); else rank 1 raises ``error`` matching ``message`` and
    the others raise RuntimeError matching ``REJECTED``."""

    call: Callable[[Ctx], Any]
    message: str
    error: type[BaseException] = RuntimeError
    everywhere: bool = False


def _wide(c: Ctx) -> torch.Tensor:
    return torch.zeros((NUM_TOKENS, 2 * HIDDEN), dtype=BF16, device=c.device)[:, ::2]


def _fp8(c: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    return c.x.float().to(FP8), torch.ones((NUM_TOKENS, 1), device=c.device)


def _with_id(c: Ctx, value: int) -> torch.Tensor:
    idx = c.idx.clone()
    idx[0, 0] = value
    return idx


def _ll_idx(c: Ctx, value: int) -> torch.Tensor:
    return _with_id(c, value)


def _cpu_only_event() -> Any:
    """A ``torch.cuda.Event`` for calls on CPU tensors, which must reject it. A CPU-only torch
    cannot make a real one: an instance made without its constructor passes the type check."""
    try:
        return torch.cuda.Event()
    except RuntimeError:  # "Tried to instantiate dummy base class Event"
        return object.__new__(torch.cuda.Event)


def _layout(c: Ctx, idx: torch.Tensor | None = None) -> Any:
    return c.ep.get_dispatch_layout(c.idx if idx is None else idx, c.num_experts)


def _dispatch_with_layout_modified_in_place(c: Ctx) -> Any:
    layout = _layout(c)
    if c.bad:
        layout.send_pos.add_(0)  # same values, new version
    return c.dispatch(layout=layout)


def _dispatch_modified_since_layout(c: Ctx) -> Any:
    if not c.bad:
        return c.dispatch(layout=_layout(c))
    idx = c.idx.clone()
    layout = _layout(c, idx)
    idx.add_(0)  # same values, new version
    return c.dispatch(topk_idx=idx, layout=layout)


def _inconsistent_handle(c: Ctx) -> Any:
    h = c.out.handle
    return dataclasses.replace(h, num_tokens_per_rank=h.num_tokens_per_rank.flip(0) + 1)


CASES: dict[str, Case] = {
    # ---- dispatch: this rank's arguments ----------------------------------------------------
    "x_int32": Case(lambda c: c.dispatch(x=c.pick(c.x, c.x.int())), "x must be bfloat16"),
    "x_1d": Case(lambda c: c.dispatch(x=c.pick(c.x, c.x.reshape(-1))), "x must be 2-D"),
    "x_3d": Case(lambda c: c.dispatch(x=c.pick(c.x, c.x.unsqueeze(0))), "x must be 2-D"),
    "x_non_contiguous": Case(lambda c: c.dispatch(x=c.pick(c.x, _wide(c))), "x must be contiguous"),
    "x_row_not_16_bytes": Case(
        lambda c: c.dispatch(x=c.pick(c.x, c.x[:, :60].contiguous())), "multiple of 16 bytes"
    ),
    "x_not_a_tensor": Case(
        lambda c: c.dispatch(x=c.pick(c.x, c.x.tolist())), "x must be a tensor", TypeError
    ),
    "fp8_without_scales": Case(
        lambda c: c.dispatch(x=c.pick(c.x, _fp8(c)[0])), "FP8 x needs x_scales"
    ),
    "scales_with_bf16_x": Case(
        lambda c: c.dispatch(x_scales=c.pick(None, torch.ones((NUM_TOKENS, 1), device=c.device))),
        "x_scales are only accepted with FP8 x",
    ),
    "scales_wrong_rows": Case(
        lambda c: c.dispatch(
            x=_fp8(c)[0],
            x_scales=c.pick(_fp8(c)[1], torch.ones((NUM_TOKENS + 1, 1), device=c.device)),
        ),
        "x_scales has 6 rows but x has 5",
    ),
    "scales_float16": Case(
        lambda c: c.dispatch(x=_fp8(c)[0], x_scales=c.pick(_fp8(c)[1], _fp8(c)[1].half())),
        "x_scales must be float32 or int32",
    ),
    "tuple_x_and_x_scales": Case(
        lambda c: c.dispatch(x=_fp8(c), x_scales=c.pick(None, _fp8(c)[1])),
        r"either as \(x, scales\)",
        TypeError,
    ),
    "previous_event_not_an_event": Case(
        lambda c: c.dispatch(previous_event=c.pick(None, 7)),
        "previous_event must be a torch.cuda.Event, got int",
        TypeError,
    ),
    "previous_event_on_cpu": Case(
        lambda c: c.dispatch(previous_event=c.pick(None, _cpu_only_event())),
        "previous_event needs CUDA tensors",
        ValueError,
    ),
    "topk_idx_float": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, c.idx.float())),
        "topk_idx must be int64 or int32",
    ),
    "topk_idx_wrong_rows": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, c.idx[:-1])),
        "topk_idx has 4 rows but x has 5 tokens",
    ),
    "topk_idx_1d": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, c.idx[:, 0].contiguous())),
        "topk_idx must be 2-D",
    ),
    "topk_33": Case(
        lambda c: c.dispatch(
            topk_idx=c.pick(
                c.idx, torch.zeros((NUM_TOKENS, 33), dtype=torch.long, device=c.device)
            ),
            topk_weights=None,
        ),
        r"top-k must be in \[1, 32\], got 33",
    ),
    "topk_idx_not_a_tensor": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, c.idx.tolist())),
        "topk_idx must be a tensor",
        TypeError,
    ),
    "expert_id_too_large": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, _with_id(c, c.num_experts))),
        r"topk_idx values must be in \[-1, num_experts=",
    ),
    "expert_id_below_minus_one": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, _with_id(c, -2))),
        # CPU names the smallest value; the CUDA layout kernel the first bad one and its place.
        r"topk_idx values must be in \[-1, num_experts=.*(min -2|got -2 at token)",
    ),
    "num_experts_not_multiple_of_ranks": Case(
        lambda c: c.dispatch(num_experts=c.pick(c.num_experts, c.num_experts + 1)),
        "is not a multiple of the group size",
    ),
    "num_experts_zero": Case(
        lambda c: c.dispatch(num_experts=c.pick(c.num_experts, 0)),
        "num_experts must be positive",
    ),
    "num_experts_negative": Case(
        lambda c: c.dispatch(num_experts=c.pick(c.num_experts, -c.num_experts)),
        "num_experts must be positive",
    ),
    "num_experts_float": Case(
        lambda c: c.dispatch(num_experts=c.pick(c.num_experts, float(c.num_experts))),
        "num_experts must be an int",
        TypeError,
    ),
    "weights_float64": Case(
        lambda c: c.dispatch(topk_weights=c.pick(c.weights, c.weights.double())),
        "topk_weights must be float32",
    ),
    "weights_wrong_shape": Case(
        lambda c: c.dispatch(topk_weights=c.pick(c.weights, c.weights[:, :1].contiguous())),
        "topk_weights must have the shape of topk_idx",
    ),
    "expert_alignment_zero": Case(
        lambda c: c.ep.dispatch(
            c.x, c.idx, c.weights, c.num_experts, expert_alignment=c.pick(1, 0)
        ),
        "expert_alignment must be >= 1",
    ),
    "num_worst_tokens_negative": Case(
        lambda c: c.ep.dispatch(
            c.x, c.idx, c.weights, c.num_experts, num_worst_tokens=c.pick(0, -1)
        ),
        "num_worst_tokens must be >= 0",
    ),
    "layout_not_a_layout": Case(
        lambda c: c.dispatch(layout=c.pick(_layout(c), tuple(_layout(c)))),
        "layout must be a DispatchLayout",
        TypeError,
    ),
    "layout_of_another_topk_idx": Case(
        lambda c: c.dispatch(layout=c.pick(_layout(c), _layout(c, c.idx.clone()))),
        "layout was computed from another topk_idx",
        ValueError,
    ),
    "layout_topk_idx_modified_since": Case(
        _dispatch_modified_since_layout,
        "topk_idx was modified in place after get_dispatch_layout",
        ValueError,
    ),
    "layout_built_by_hand": Case(
        lambda c: c.dispatch(
            layout=c.pick(_layout(c), c.ep.DispatchLayout(*_layout(c), _layout(c).send_pos))
        ),
        "layout must come from ep_backend.get_dispatch_layout",
        ValueError,
    ),
    "layout_other_num_experts": Case(
        lambda c: c.dispatch(
            num_experts=2 * c.num_experts,
            layout=c.pick(c.ep.get_dispatch_layout(c.idx, 2 * c.num_experts), _layout(c)),
        ),
        r"layout was computed for num_experts=\d+ on \d+ ranks, this call has",
        ValueError,
    ),
    "layout_send_pos_int64": Case(
        lambda c: c.dispatch(
            layout=c.pick(
                _layout(c), dataclasses.replace(_layout(c), send_pos=_layout(c).send_pos.long())
            )
        ),
        "layout.send_pos is not the tensor get_dispatch_layout returned",
        ValueError,
    ),
    # On CUDA nothing compares a layout's values with topk_idx (a host read): the tensors must
    # be the ones get_dispatch_layout returned, unmodified.
    "layout_values_not_of_topk_idx": Case(
        lambda c: c.dispatch(
            layout=c.pick(
                _layout(c),
                dataclasses.replace(_layout(c), is_token_in_rank=~_layout(c).is_token_in_rank),
            )
        ),
        "layout.is_token_in_rank is not the tensor get_dispatch_layout returned",
        ValueError,
    ),
    "layout_modified_in_place": Case(
        _dispatch_with_layout_modified_in_place,
        "layout.send_pos was modified in place after get_dispatch_layout",
        ValueError,
    ),
    # ---- reserve ----------------------------------------------------------------------------
    "reserve_num_tokens_zero": Case(
        lambda c: c.ep.reserve(c.pick(8, 0), HIDDEN, TOPK, c.num_experts),
        "num_tokens must be positive",
    ),
    "reserve_row_not_16_bytes": Case(
        lambda c: c.ep.reserve(8, c.pick(HIDDEN, 3), TOPK, c.num_experts),
        "multiple of 16 bytes, got 6",
    ),
    "reserve_topk_33": Case(
        lambda c: c.ep.reserve(8, HIDDEN, c.pick(TOPK, 33), c.num_experts),
        r"num_topk must be in \[1, 32\], got 33",
    ),
    "reserve_experts_not_multiple": Case(
        lambda c: c.ep.reserve(8, HIDDEN, TOPK, c.pick(c.num_experts, c.num_experts + 1)),
        "num_experts must be a positive multiple of the group size",
    ),
    "reserve_hidden_float": Case(
        lambda c: c.ep.reserve(8, c.pick(HIDDEN, 64.0), TOPK, c.num_experts),
        "hidden must be an int",
        TypeError,
    ),
    "reserve_dtype_string": Case(
        lambda c: c.ep.reserve(8, HIDDEN, TOPK, c.num_experts, dtype=c.pick(BF16, "bf16")),
        "dtype must be a torch.dtype",
        TypeError,
    ),
    "handle_with_layout": Case(
        lambda c: c.ep.dispatch(c.x, handle=c.out.handle, layout=c.pick(None, _layout(c))),
        "with handle= .*must be None",
        ValueError,
    ),
    "handle_with_topk_idx": Case(
        lambda c: c.ep.dispatch(c.x, c.pick(None, c.idx), handle=c.out.handle),
        "with handle= .*must be None",
        ValueError,
    ),
    "no_topk_idx_without_handle": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, None)),
        "topk_idx and num_experts are required",
        ValueError,
    ),
    # ---- dispatch: ranks disagree, or a check over all ranks' counts ------------------------
    "disagree_on_num_experts": Case(
        lambda c: c.dispatch(num_experts=c.pick(c.num_experts, 2 * c.num_experts)),
        "ranks disagree on num_experts",
        everywhere=True,
    ),
    "disagree_on_hidden": Case(
        lambda c: c.dispatch(
            x=c.pick(c.x, torch.zeros((NUM_TOKENS, HIDDEN + 8), dtype=BF16, device=c.device))
        ),
        "ranks disagree on hidden size H",
        everywhere=True,
    ),
    "disagree_on_dtype": Case(
        lambda c: c.dispatch(x=c.pick(c.x, c.x.half())),
        "ranks disagree on x dtype",
        everywhere=True,
    ),
    "disagree_on_topk": Case(
        lambda c: c.dispatch(
            topk_idx=c.pick(c.idx, torch.cat([c.idx, c.idx[:, :1]], 1)), topk_weights=None
        ),
        "ranks disagree on top-k",
        everywhere=True,
    ),
    "disagree_on_topk_idx_dtype": Case(
        lambda c: c.dispatch(topk_idx=c.pick(c.idx, c.idx.int())),
        "ranks disagree on topk_idx dtype",
        everywhere=True,
    ),
    "disagree_on_weights": Case(
        lambda c: c.dispatch(topk_weights=c.pick(c.weights, None)),
        "ranks disagree on presence of topk_weights",
        everywhere=True,
    ),
    "disagree_on_num_worst_tokens": Case(
        lambda c: c.ep.dispatch(c.x, c.idx, None, c.num_experts, num_worst_tokens=c.pick(50, 60)),
        "ranks disagree on num_worst_tokens",
        everywhere=True,
    ),
    "num_worst_tokens_too_small": Case(
        lambda c: c.ep.dispatch(c.x, c.idx, None, c.num_experts, num_worst_tokens=2),
        "num_worst_tokens=2 is smaller than the rows a rank receives",
        everywhere=True,
    ),
    # ---- cached dispatch ------------------------------------------------------------------
    "cached_handle_from_other_routing": Case(
        lambda c: c.ep.dispatch(c.x, handle=c.pick(c.out.handle, c.all_to_rank0.handle)),
        "the handle does not match across ranks",
        everywhere=True,
    ),
    "cached_handle_from_other_group_size": Case(
        lambda c: c.ep.dispatch(c.x, handle=c.pick(c.out.handle, c.other_group_out.handle)),
        "the handle was made on (a group of|group )",  # its group is checked first
    ),
    "cached_handle_is_a_tuple": Case(
        lambda c: c.ep.dispatch(c.x, handle=c.pick(c.out.handle, tuple(c.out.handle.__dict__))),
        "handle must be a DispatchHandle, got tuple",
        TypeError,
    ),
    "cached_handle_inconsistent": Case(
        lambda c: c.ep.dispatch(c.x, handle=c.pick(c.out.handle, _inconsistent_handle(c))),
        "num_tokens_per_rank does not match its is_token_in_rank",
    ),
    "cached_x_wrong_rows": Case(
        lambda c: c.ep.dispatch(c.pick(c.x, c.x[:-1]), handle=c.out.handle),
        "the handle was made for 5 tokens, this call has 4",
    ),
    "cached_fp8_without_scales": Case(
        lambda c: c.ep.dispatch(c.pick(c.x, _fp8(c)[0]), handle=c.out.handle),
        "FP8 x needs x_scales",
    ),
    # ---- combine ----------------------------------------------------------------------------
    "combine_previous_event_not_an_event": Case(
        lambda c: c.combine(previous_event=c.pick(None, "after you")),
        "previous_event must be a torch.cuda.Event, got str",
        TypeError,
    ),
    "combine_previous_event_on_cpu": Case(
        lambda c: c.combine(previous_event=c.pick(None, _cpu_only_event())),
        "previous_event needs CUDA tensors",
        ValueError,
    ),
    "combine_x_wrong_rows": Case(
        lambda c: c.combine(x=c.pick(c.out.recv_x, c.out.recv_x[:-1])),
        "rows but the dispatch that made the handle returned",
    ),
    "combine_x_int": Case(
        lambda c: c.combine(x=c.pick(c.out.recv_x, c.out.recv_x.int())), "combine sums rows"
    ),
    "combine_bias_wrong_shape": Case(
        lambda c: c.combine(bias=c.pick(c.x, c.x[:, :-1])), r"bias must be \[T, H\]"
    ),
    "combine_second_bias_wrong_shape": Case(
        lambda c: c.combine(bias=(c.x, c.pick(c.x, c.x[:-1]))), r"bias must be \[T, H\]"
    ),
    "combine_three_biases": Case(
        lambda c: c.combine(bias=c.pick((c.x, c.x), (c.x, c.x, c.x))),
        "at most two bias tensors",
        ValueError,
    ),
    "combine_bias_int": Case(
        lambda c: c.combine(bias=c.pick(c.x, c.x.int())), "bias must be bfloat16"
    ),
    "combine_weights_float64": Case(
        lambda c: c.combine(
            topk_weights=c.pick(c.out.recv_topk_weights, c.out.recv_topk_weights.double())
        ),
        "topk_weights must be float32",
    ),
    "combine_handle_is_a_tuple": Case(
        lambda c: c.combine(handle=c.pick(c.out.handle, (1, 2))),
        "handle must be a DispatchHandle, got tuple",
        TypeError,
    ),
    "combine_handle_from_other_routing": Case(
        lambda c: c.combine(
            x=c.pick(c.out.recv_x, c.all_to_rank0.recv_x),
            handle=c.pick(c.out.handle, c.all_to_rank0.handle),
        ),
        "the handle does not match across ranks",
        everywhere=True,
    ),
    "combine_handle_from_other_group_size": Case(
        lambda c: c.combine(
            x=c.pick(c.out.recv_x, c.other_group_out.recv_x),
            handle=c.pick(c.out.handle, c.other_group_out.handle),
        ),
        "the handle was made on (a group of|group )",  # its group is checked first
    ),
    "combine_disagree_on_hidden": Case(
        lambda c: c.combine(x=c.pick(c.out.recv_x, c.out.recv_x[:, : HIDDEN // 2].contiguous())),
        "ranks disagree on hidden size H",
        everywhere=True,
    ),
    # ---- low-latency dispatch -------------------------------------------------------------
    "ll_tokens_over_max": Case(
        lambda c: c.ll_dispatch(
            x=c.pick(
                c.ll_x, torch.zeros((LL_MAX_TOKENS + 1, LL_HIDDEN), dtype=BF16, device=c.device)
            ),
            topk_idx=c.pick(
                c.idx, torch.zeros((LL_MAX_TOKENS + 1, TOPK), dtype=torch.long, device=c.device)
            ),
        ),
        "T=7 tokens exceed num_max_dispatch_tokens_per_rank=6",
    ),
    "ll_hidden_not_multiple_of_128": Case(
        lambda c: c.ll_dispatch(
            x=c.pick(c.ll_x, torch.zeros((NUM_TOKENS, 200), dtype=BF16, device=c.device))
        ),
        "H must be a positive multiple of 128, got 200",
    ),
    "ll_x_float32": Case(
        lambda c: c.ll_dispatch(x=c.pick(c.ll_x, c.ll_x.float())), "x must be bfloat16"
    ),
    "ll_ue8m0_without_round_scale": Case(
        lambda c: c.ll_dispatch(
            x=torch.zeros((NUM_TOKENS, 512), dtype=BF16, device=c.device),
            use_fp8=True,
            use_ue8m0=c.pick(False, True),
        ),
        "use_ue8m0 requires round_scale",
    ),
    "ll_ue8m0_hidden_not_512": Case(
        lambda c: c.ll_dispatch(use_fp8=True, round_scale=True, use_ue8m0=c.pick(False, True)),
        "use_ue8m0 needs H % 512 == 0",
    ),
    "ll_expert_repeated_beyond_max": Case(
        lambda c: c.ll_dispatch(
            num_max_dispatch_tokens_per_rank=5,
            topk_idx=c.pick(c.idx, torch.zeros((NUM_TOKENS, 2), dtype=torch.long, device=c.device)),
        ),
        "at most num_max_dispatch_tokens_per_rank rows to one expert",
    ),
    "ll_expert_id_too_large": Case(
        lambda c: c.ll_dispatch(topk_idx=c.pick(c.idx, _ll_idx(c, c.num_experts))),
        r"topk_idx values must be in \[-1",
    ),
    "ll_stats_wrong_dtype": Case(
        lambda c: c.ll_dispatch(
            cumulative_local_expert_recv_stats=c.pick(
                torch.zeros(2, dtype=torch.int32, device=c.device),
                torch.zeros(2, dtype=torch.int64, device=c.device),
            )
        ),
        "cumulative_local_expert_recv_stats must be int32",
        ValueError,
    ),
    "ll_async_and_hook": Case(
        lambda c: c.ll_dispatch(async_op=c.pick(False, True), return_recv_hook=True),
        "async_op and return_recv_hook exclude each other",
        ValueError,
    ),
    "ll_disagree_on_max_tokens": Case(
        lambda c: c.ll_dispatch(num_max_dispatch_tokens_per_rank=c.pick(6, 8)),
        "ranks disagree on num_max_dispatch_tokens_per_rank",
        everywhere=True,
    ),
    "ll_disagree_on_num_experts": Case(
        lambda c: c.ll_dispatch(num_experts=c.pick(c.num_experts, 2 * c.num_experts)),
        "ranks disagree on num_experts",
        everywhere=True,
    ),
    "ll_disagree_on_fp8": Case(
        lambda c: c.ll_dispatch(use_fp8=c.pick(False, True)),
        "ranks disagree on use_fp8",
        everywhere=True,
    ),
    # ---- low-latency combine --------------------------------------------------------------
    "ll_combine_wrong_slots": Case(
        lambda c: c.ll_combine(x=c.pick(c.ll_out.recv_x, c.ll_out.recv_x[:, :-1].contiguous())),
        "slots per expert, the handle expects R\\*M=",
    ),
    "ll_combine_x_2d": Case(
        lambda c: c.ll_combine(x=c.pick(c.ll_out.recv_x, c.ll_out.recv_x[0])),
        r"x must be \[E_loc, R\*M, H\]",
    ),
    "ll_combine_x_float32": Case(
        lambda c: c.ll_combine(x=c.pick(c.ll_out.recv_x, c.ll_out.recv_x.float())),
        "x must be bfloat16",
    ),
    "ll_combine_disagree_on_hidden": Case(
        lambda c: c.ll_combine(x=c.pick(c.ll_out.recv_x, torch.cat([c.ll_out.recv_x] * 2, 2))),
        "ranks disagree on hidden size H",
        everywhere=True,
    ),
    "ll_combine_handle_is_a_tuple": Case(
        lambda c: c.ll_combine(handle=c.pick(c.ll_out.handle, (1, 2))),
        "handle must be a LowLatencyHandle, got tuple",
        TypeError,
    ),
    "ll_combine_out_wrong_shape": Case(
        lambda c: c.ll_combine(
            out=c.pick(None, torch.zeros((NUM_TOKENS, LL_HIDDEN + 1), dtype=BF16, device=c.device))
        ),
        "out must be BF16",
        ValueError,
    ),
    "ll_combine_weights_wrong_shape": Case(
        lambda c: c.ll_combine(topk_weights=c.pick(c.weights, c.weights[:, :1])),
        "topk_weights must be float32 with the shape of topk_idx",
    ),
    "ll_combine_expert_id_too_large": Case(
        lambda c: c.ll_combine(topk_idx=c.pick(c.idx, _ll_idx(c, c.num_experts))),
        r"topk_idx values must be in \[-1",
    ),
    "ll_combine_other_routing": Case(
        lambda c: c.ll_combine(topk_idx=c.pick(c.idx, torch.full_like(c.idx, -1))),
        "the handle does not match across ranks",
        everywhere=True,
    ),
}


# --------------------------------------------------------------------------------------------
# The worker: every case, then a valid call, on every rank
# --------------------------------------------------------------------------------------------


def _routing(rank: int, world: int) -> torch.Tensor:
    """Token t -> experts (t + rank) % E and (t + rank + 1) % E: every rank sends to several."""
    num_experts = 2 * world
    t = torch.arange(NUM_TOKENS).unsqueeze(1) + rank
    return torch.cat([t, t + 1], 1) % num_experts


def _make_ctx(ep, rank: int, world: int, device: torch.device = CPU) -> Ctx:
    gen = torch.Generator().manual_seed(rank)
    num_experts = 2 * world
    x = torch.randn((NUM_TOKENS, HIDDEN), generator=gen).to(BF16).to(device)
    idx = _routing(rank, world).to(device)
    weights = torch.rand((NUM_TOKENS, TOPK), generator=gen).to(device)
    out = ep.dispatch(x, idx, weights, num_experts)
    all_to_rank0 = ep.dispatch(x, torch.zeros_like(idx), None, num_experts)
    # Subgroups of another size (every rank creates all of them, in the same order).
    size = 1 if world == 2 else 2
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    group = groups[rank // size]
    other_group_out = ep.dispatch(x, idx % (2 * size), None, 2 * size, group=group)
    ll_x = torch.randn((NUM_TOKENS, LL_HIDDEN), generator=gen).to(BF16).to(device)
    ll_out = ep.low_latency_dispatch(ll_x, idx, LL_MAX_TOKENS, num_experts, use_fp8=False)
    return Ctx(rank, world, ep, num_experts, x, idx, weights, out, all_to_rank0,
               other_group_out, ll_x, ll_out, device)  # fmt: skip


def _valid_round_trip(
    ep, ref, rank: int, world: int, step: int, device: torch.device = CPU, ref_group: Any = None
) -> list[str]:
    """A valid dispatch + combine on ``device`` against the reference on CPU (bitwise), whose
    collectives run on ``ref_group`` (default: WORLD)."""
    m = Mismatches(context="valid call after the case")
    gen = torch.Generator().manual_seed(1000 * step + rank)
    num_experts = 2 * world
    num_tokens = (step + rank) % 4
    x = torch.randn((num_tokens, 24), generator=gen).to(BF16)
    idx = torch.randint(-1, num_experts, (num_tokens, 3), generator=gen)
    weights = torch.rand((num_tokens, 3), generator=gen)
    # The reference first: its collectives then never wait on a rank that an error in the
    # op under test sent on to its next case.
    b = ref.dispatch(x, idx, weights, num_experts, expert_alignment=2, group=ref_group)
    y = scale_rows(b.recv_x, 3.0)
    want = ref.combine(y, b.handle, b.recv_topk_weights, bias=x, group=ref_group)
    a = ep.dispatch(x.to(device), idx.to(device), weights.to(device), num_experts,
                    expert_alignment=2)  # fmt: skip
    compare_dispatch(m, a, b)
    got = ep.combine(y.to(device), a.handle, b.recv_topk_weights.to(device), bias=x.to(device))
    compare_combine(m, got, want)
    return m.items


def case_worker(
    rank: int, world: int, module: str, names: list[str], device_type: str = "cpu"
) -> dict[str, Any]:
    """One rank's outcomes of the cases ``names`` of ``module.CASES`` (each has a ``call``),
    each followed by a valid round trip: per case, ``error`` (``None``, or the exception's
    ``name``, ``message`` and ``bases``, the names of its type's MRO), ``seconds`` and
    ``after`` (the round trip's mismatches). The tensors are on ``device_type`` (``"cuda"``: this
    rank's GPU, the reference still on CPU). Shared with ``test_malformed_calls``."""
    import ep_backend as ep
    from ep_backend import reference as ref

    cases = importlib.import_module(module).CASES
    single_thread()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else (
        torch.device("cpu"))  # fmt: skip
    ready_start = time.monotonic()
    ctx = _make_ctx(ep, rank, world, device)
    # On CUDA the reference's CPU collectives run on a plain Gloo group of their own, apart
    # from the "ep" group under test.
    ref_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    print(f"[rank {rank}] context ready in {time.monotonic() - ready_start:.2f} s", file=sys.stderr,
          flush=True)  # fmt: skip
    outcomes: dict[str, Any] = {}
    for step, name in enumerate(names):
        start = time.monotonic()
        # A case (or its round trip) stuck this long prints every thread's Python stack on
        # stderr: the parent's timeout alone would not say where this rank waits.
        faulthandler.dump_traceback_later(STUCK_CASE_SECONDS)
        try:
            cases[name].call(ctx)
            if device.type == "cuda":  # an error found on the GPU is raised by a later sync
                torch.cuda.synchronize()
            error = None
        except Exception as exc:  # recorded, checked by the parent
            error = {
                "name": type(exc).__name__,
                "message": str(exc),
                "bases": [k.__name__ for k in type(exc).__mro__],
            }
        elapsed = time.monotonic() - start
        try:
            after = _valid_round_trip(ep, ref, rank, world, step, device, ref_group)
        except Exception as exc:  # e.g. an error the kernels found, raised by this next call
            after = [f"the valid call after the case raised {type(exc).__name__}: {exc}"]
        faulthandler.cancel_dump_traceback_later()
        outcomes[name] = {"error": error, "seconds": elapsed, "after": after}
        # One line per case on stderr (pytest shows it for a failed or interrupted run): a case
        # that hangs is the one after the last line.
        print(f"[rank {rank}] case {step} {name}: {elapsed:.2f} s, raised "
              f"{error['name'] if error else None}; after: {'; '.join(after)[:400] or 'exact'}",
              file=sys.stderr, flush=True)  # fmt: skip
    return outcomes


_RESULTS: dict[int, list[dict[str, Any]]] = {}


def _results(world: int) -> list[dict[str, Any]]:
    """All cases' outcomes per rank for one world size (one worker run, cached per process)."""
    if world not in _RESULTS:
        _RESULTS[world] = run_distributed(
            case_worker, world, __name__, list(CASES), backend="ep", timeout=TIMEOUT
        )
    return _RESULTS[world]


def test_enough_cases() -> None:
    assert len(CASES) >= 25


def check_every_rank_raised(case: Case, per_rank: list[dict[str, Any]]) -> None:
    """The contract for one case, from every rank's outcome (see ``case_worker``)."""
    for rank, outcome in enumerate(per_rank):
        assert outcome["error"] is not None, f"rank {rank} did not raise"
        type_name, message, bases = (outcome["error"][k] for k in ("name", "message", "bases"))
        if case.everywhere or rank == 1:
            expected_type, pattern = (case.error if rank == 1 else RuntimeError), case.message
        else:
            expected_type, pattern = RuntimeError, REJECTED
        # The MoE errors keep the types these cases were written for as bases.
        described = f"rank {rank}: {type_name}: {message}"
        assert expected_type.__name__ in bases, described
        # Every rank raises MoEInputError; the rank that passed a wrong type its MoETypeError.
        assert "MoEInputError" in bases, described
        assert ("MoETypeError" in bases) == (case.error is TypeError and rank == 1), described
        assert "Exception raised from" not in message, described  # no C++ stack
        assert re.search(pattern, message), f"rank {rank}: {message!r} !~ {pattern!r}"
        assert "nothing was exchanged" in message.lower() or rank == 1, message
        assert outcome["seconds"] < CASE_SECONDS, f"rank {rank} took {outcome['seconds']:.1f} s"
        assert not outcome["after"], f"rank {rank}: " + "; ".join(outcome["after"])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises(world: int, name: str) -> None:
    check_every_rank_raised(CASES[name], [outcome[name] for outcome in _results(world)])
