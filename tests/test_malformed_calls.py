"""A malformed call to any MoE collective raises the documented type on every rank, quickly.

The contract (docs/api.md, "Failures"): a bad argument on one rank (or every rank), or ranks
that disagree, raise ``ep_backend.MoEInputError`` on every rank of the call; the rank that passed
an argument of the wrong type raises its subclass ``MoETypeError``. No rank waits for the
group's timeout, no rank's call pairs with a peer's next call, and the next valid dispatch and
combine equal ``ep_backend.reference`` bit for bit.

``test_moe_validation`` checks its cases (messages and these types); the cases here are the ones
that used to leave one rank outside the agreement: tensors on the ``meta`` device, whose meta
kernel ran instead of the op, and flags of the wrong type, which the dispatcher refused before the
op. They run in one 2-rank run of ``test_moe_validation``'s worker, one process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from _dist_utils import run_distributed
from moe_helpers import BF16, scale_rows
from test_moe_validation import CASES as VALIDATION_CASES
from test_moe_validation import HIDDEN, LL_MAX_TOKENS, NUM_TOKENS, TOPK, Ctx, _layout, case_worker

WORLD = 2
CASE_SECONDS = 5.0  # every rank must raise well within this (the group timeout is TIMEOUT)
TIMEOUT = 90.0  # the group timeout and the bound of the whole run


@dataclass(frozen=True)
class Malformed:
    """A malformed call. ``type_error``: the bad rank raises ``MoETypeError``; ``all_bad``:
    every rank passes the bad argument (each then raises its own error)."""

    call: Callable[[Ctx], Any]
    type_error: bool = False
    all_bad: bool = False


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def _meta_on_1(c: Ctx, t: torch.Tensor) -> torch.Tensor:
    return c.pick(t, _meta(t))


def _meta_handle(c: Ctx, field: str) -> Any:
    h = c.out.handle
    return c.pick(h, replace(h, **{field: _meta(getattr(h, field))}))


def _meta_layout(c: Ctx, field: str) -> Any:
    layout = _layout(c)
    return c.pick(layout, replace(layout, **{field: _meta(getattr(layout, field))}))


def _fp8_dispatch_meta_scales(c: Ctx) -> Any:
    x8 = c.x.float().to(torch.float8_e4m3fn)
    scales = torch.ones((NUM_TOKENS, 1), device=c.device)
    return c.dispatch(x=x8, x_scales=_meta_on_1(c, scales))


NEW_CASES: dict[str, Malformed] = {
    # ---- tensors on the meta device (the op's meta kernel used to run without the agreement) --
    "meta_x": Malformed(lambda c: c.dispatch(x=_meta_on_1(c, c.x))),
    "meta_topk_idx": Malformed(lambda c: c.dispatch(topk_idx=_meta_on_1(c, c.idx))),
    "meta_topk_weights": Malformed(lambda c: c.dispatch(topk_weights=_meta_on_1(c, c.weights))),
    "meta_x_scales": Malformed(_fp8_dispatch_meta_scales),
    "meta_x_every_rank": Malformed(lambda c: c.dispatch(x=_meta(c.x)), all_bad=True),
    "meta_x_worst_tokens": Malformed(
        lambda c: c.ep.dispatch(_meta_on_1(c, c.x), c.idx, None, c.num_experts, num_worst_tokens=64)
    ),
    "meta_layout_send_pos": Malformed(lambda c: c.dispatch(layout=_meta_layout(c, "send_pos"))),
    "meta_layout_in_rank": Malformed(
        lambda c: c.dispatch(layout=_meta_layout(c, "is_token_in_rank"))
    ),
    "meta_cached_x": Malformed(lambda c: c.ep.dispatch(_meta_on_1(c, c.x), handle=c.out.handle)),
    "meta_cached_handle": Malformed(
        lambda c: c.ep.dispatch(c.x, handle=_meta_handle(c, "recv_src_idx"))
    ),
    "meta_combine_x": Malformed(lambda c: c.combine(x=_meta_on_1(c, c.out.recv_x))),
    "meta_combine_weights": Malformed(
        lambda c: c.combine(topk_weights=_meta_on_1(c, c.out.recv_topk_weights))
    ),
    "meta_combine_bias": Malformed(lambda c: c.combine(bias=_meta_on_1(c, c.x))),
    "meta_combine_handle": Malformed(
        lambda c: c.combine(handle=_meta_handle(c, "is_token_in_rank"))
    ),
    "meta_ll_x": Malformed(lambda c: c.ll_dispatch(x=_meta_on_1(c, c.ll_x))),
    "meta_ll_topk_idx": Malformed(lambda c: c.ll_dispatch(topk_idx=_meta_on_1(c, c.idx))),
    "meta_ll_stats": Malformed(
        lambda c: c.ll_dispatch(
            cumulative_local_expert_recv_stats=_meta_on_1(
                c, torch.zeros(2, dtype=torch.int32, device=c.device)
            )
        )
    ),
    "meta_ll_x_every_rank": Malformed(lambda c: c.ll_dispatch(x=_meta(c.ll_x)), all_bad=True),
    "meta_ll_combine_x": Malformed(lambda c: c.ll_combine(x=_meta_on_1(c, c.ll_out.recv_x))),
    "meta_ll_combine_topk_idx": Malformed(lambda c: c.ll_combine(topk_idx=_meta_on_1(c, c.idx))),
    "meta_ll_combine_weights": Malformed(
        lambda c: c.ll_combine(topk_weights=_meta_on_1(c, c.weights))
    ),
    "meta_ll_combine_out": Malformed(
        lambda c: c.ll_combine(
            out=c.pick(None, torch.empty((NUM_TOKENS, c.ll_x.shape[1]), dtype=BF16, device="meta"))
        )
    ),
    # ---- flags of the wrong type (the dispatcher used to refuse them before the op) --------
    "ll_use_fp8_str": Malformed(lambda c: c.ll_dispatch(use_fp8=c.pick(False, "no")), True),
    "ll_round_scale_int": Malformed(lambda c: c.ll_dispatch(round_scale=c.pick(False, 0)), True),
    "ll_use_ue8m0_none": Malformed(lambda c: c.ll_dispatch(use_ue8m0=c.pick(False, None)), True),
    "ll_hook_str": Malformed(lambda c: c.ll_dispatch(return_recv_hook=c.pick(False, "x")), True),
    "ll_max_tokens_float": Malformed(
        lambda c: c.ll_dispatch(num_max_dispatch_tokens_per_rank=c.pick(LL_MAX_TOKENS, 6.0)), True
    ),
    "ll_combine_x_not_a_tensor": Malformed(
        lambda c: c.ll_combine(x=c.pick(c.ll_out.recv_x, 1)), True
    ),
    "combine_x_not_a_tensor": Malformed(lambda c: c.combine(x=c.pick(c.out.recv_x, [1.0])), True),
    "combine_bias_not_a_tensor": Malformed(lambda c: c.combine(bias=(c.x, c.pick(c.x, 3))), True),
    "dispatch_alignment_float": Malformed(
        lambda c: c.ep.dispatch(
            c.x, c.idx, c.weights, c.num_experts, expert_alignment=c.pick(1, 1.0)
        ),
        True,
    ),
    "reserve_num_topk_str": Malformed(
        lambda c: c.ep.reserve(8, HIDDEN, c.pick(TOPK, "2"), c.num_experts), True
    ),
    "reserve_num_scales_float": Malformed(
        lambda c: c.ep.reserve(8, HIDDEN, TOPK, c.num_experts, num_scales=c.pick(None, 1.5)), True
    ),
    # ---- every rank bad at once --------------------------------------------------------------
    "every_rank_x_int32": Malformed(lambda c: c.dispatch(x=c.x.int()), all_bad=True),
    "every_rank_num_experts_odd": Malformed(
        lambda c: c.dispatch(num_experts=c.num_experts + 1), all_bad=True
    ),
    "every_rank_ll_hidden_200": Malformed(
        lambda c: c.ll_dispatch(x=torch.zeros((NUM_TOKENS, 200), dtype=BF16, device=c.device)),
        all_bad=True,
    ),
    "every_rank_combine_int": Malformed(
        lambda c: c.combine(x=scale_rows(c.out.recv_x, 1.0).int()), all_bad=True
    ),
}


CASES: dict[str, Malformed] = NEW_CASES


_RESULTS: list[dict[str, Any]] = []


def _results() -> list[dict[str, Any]]:
    if not _RESULTS:
        _RESULTS.extend(
            run_distributed(
                case_worker, WORLD, __name__, list(CASES), backend="ep", timeout=TIMEOUT
            )
        )
    return _RESULTS


def test_at_least_sixty_cases() -> None:
    assert len(VALIDATION_CASES) + len(NEW_CASES) >= 60
    assert len(NEW_CASES) >= 30


def check_documented_type(case: Malformed, per_rank: list[dict[str, Any]]) -> None:
    """The contract for one case, from every rank's outcome (see ``case_worker``)."""
    for rank, outcome in enumerate(per_rank):
        error = outcome["error"]
        assert error is not None, f"rank {rank} did not raise"
        described = f"rank {rank}: {error['name']}: {error['message']}"
        assert "MoEInputError" in error["bases"], described
        bad = rank == 1 or case.all_bad
        assert ("MoETypeError" in error["bases"]) == (case.type_error and bad), described
        assert "Exception raised from" not in error["message"], described  # no C++ stack
        assert outcome["seconds"] < CASE_SECONDS, f"rank {rank} took {outcome['seconds']:.1f} s"
        assert not outcome["after"], f"rank {rank}: " + "; ".join(outcome["after"])


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_documented_type(name: str) -> None:
    check_documented_type(CASES[name], [outcome[name] for outcome in _results()])
