"""MoE calls never pair across kinds or call numbers: every rank raises, naming both calls.

Each MoE collective's agreement carries the op's kind and the group's call number. Ranks in
different collectives (or, after a fault, at different call numbers) raise ``MoEInputError`` on
every rank, "rank 1 is in call #12 (combine), this rank (0) in call #12 (dispatch)", and nothing
is exchanged: the next valid call on every rank equals ``ep_backend.reference`` bit for bit. A
rank whose input the Python layer rejected joins the agreement under the op it was called as.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist_utils import run_distributed
from moe_helpers import single_thread
from test_moe_validation import Ctx, _make_ctx, _valid_round_trip

WORLD = 2


def _dispatch(c: Ctx) -> Any:
    return c.ep.dispatch(c.x, c.idx, c.weights, c.num_experts)


def _cached(c: Ctx) -> Any:
    return c.ep.dispatch(c.x, handle=c.out.handle)


def _combine(c: Ctx) -> Any:
    return c.ep.combine(c.out.recv_x, c.out.handle, c.out.recv_topk_weights)


def _ll_dispatch(c: Ctx) -> Any:
    return c.ep.low_latency_dispatch(c.ll_x, c.idx, 8, c.num_experts, use_fp8=False)


def _reserve(c: Ctx) -> Any:
    return c.ep.reserve(8, 64, 2, c.num_experts)


def _rejected_dispatch(c: Ctx) -> Any:  # refused by the Python checks, before the op
    return c.ep.dispatch(c.x, c.idx.float(), c.weights, c.num_experts)


OPS: dict[str, tuple[Callable[[Ctx], Any], str]] = {
    "dispatch": (_dispatch, "dispatch"),
    "cached": (_cached, "cached dispatch"),
    "combine": (_combine, "combine"),
    "ll_dispatch": (_ll_dispatch, "low_latency_dispatch"),
    "reserve": (_reserve, "reserve"),
    "rejected_dispatch": (_rejected_dispatch, "dispatch"),
}

# (rank 0's op, rank 1's op)
PAIRS: list[tuple[str, str]] = [
    ("dispatch", "combine"),
    ("combine", "dispatch"),
    ("dispatch", "cached"),
    ("cached", "combine"),
    ("dispatch", "ll_dispatch"),
    ("ll_dispatch", "combine"),
    ("reserve", "dispatch"),
    ("combine", "reserve"),
    ("combine", "rejected_dispatch"),
]


def _outcome(ep: Any, call: Callable[[], Any]) -> dict[str, Any] | None:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # recorded, checked by the parent
        return {
            "input": isinstance(exc, ep.MoEInputError),
            "name": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return None


def _pairing_worker(rank: int, world: int) -> dict[str, Any]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    ctx = _make_ctx(ep, rank, world)
    results: dict[str, Any] = {}
    for step, (op0, op1) in enumerate(PAIRS):
        call, _ = OPS[op0 if rank == 0 else op1]
        results[f"{op0}/{op1}"] = {
            "error": _outcome(ep, lambda call=call: call(ctx)),
            "after": _valid_round_trip(ep, ref, rank, world, step),
        }
    # Same kind, different call numbers (as after a call one rank made alone).
    backend = ep.get_backend()
    if rank == 1:
        backend._shift_moe_calls(3)
    error = _outcome(ep, lambda: _dispatch(ctx))
    if rank == 1:
        backend._shift_moe_calls(-3)
    results["call_number"] = {"error": error, "after": _valid_round_trip(ep, ref, rank, world, 99)}
    return results


_RESULTS: list[dict[str, Any]] = []


def _results() -> list[dict[str, Any]]:
    if not _RESULTS:
        _RESULTS.extend(run_distributed(_pairing_worker, WORLD, backend="ep", timeout=90))
    return _RESULTS


def _check(rank: int, outcome: dict[str, Any]) -> dict[str, Any]:
    error = outcome["error"]
    assert error is not None, f"rank {rank} did not raise"
    described = f"rank {rank}: {error['name']}: {error['message']}"
    assert error["input"], described
    assert error["seconds"] < 5.0, described
    assert "Exception raised from" not in error["message"], described
    assert not outcome["after"], f"rank {rank}: " + "; ".join(outcome["after"])
    return error


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-vs-{p[1]}")
def test_different_collectives_raise_on_every_rank_naming_both(pair: tuple[str, str]) -> None:
    kinds = (OPS[pair[0]][1], OPS[pair[1]][1])
    for rank, results in enumerate(_results()):
        error = _check(rank, results[f"{pair[0]}/{pair[1]}"])
        peer = 1 - rank
        match = re.search(
            rf"rank {peer} is in call #(\d+) \(([^)]+)\), this rank \({rank}\) in call #(\d+) "
            r"\(([^)]+)\)",
            error["message"],
        )
        assert match is not None, error["message"]
        assert match.group(1) == match.group(3), error["message"]
        assert (match.group(2), match.group(4)) == (kinds[peer], kinds[rank]), error["message"]


def test_different_call_numbers_raise_on_every_rank_naming_both() -> None:
    for rank, results in enumerate(_results()):
        error = _check(rank, results["call_number"])
        match = re.search(r"rank (\d) is in call #(\d+) \(dispatch\), this rank \((\d)\) in call "
                          r"#(\d+) \(dispatch\)", error["message"])  # fmt: skip
        assert match is not None, error["message"]
        mine, theirs = int(match.group(4)), int(match.group(2))
        assert (mine - theirs) == (3 if rank == 1 else -3), error["message"]


def _bad_kind_on_one_rank(rank: int, world: int) -> str:
    """The op kind a Python-side rejection reports is the op the rank was called as."""
    import ep_backend as ep

    single_thread()
    x = torch.randn(4, 16).bfloat16()
    idx = torch.randint(0, 4, (4, 2))
    out = ep.dispatch(x, idx, None, 4)
    try:
        if rank == 0:
            ep.combine(out.recv_x, out.handle)
        else:
            ep.dispatch(x, idx, None, num_experts="4")  # a TypeError, refused in Python
    except ep.MoEInputError as exc:
        return str(exc)
    return "no error"


def test_a_python_rejection_carries_the_real_op_kind() -> None:
    messages = run_distributed(_bad_kind_on_one_rank, WORLD, backend="ep", timeout=60)
    assert "rank 1 is in call #" in messages[0] and "(dispatch)" in messages[0], messages[0]
    assert "this rank (0)" in messages[0] and "(combine)" in messages[0], messages[0]
    # The rejecting rank says what was wrong with its call, and that its peer was in another.
    assert "num_experts must be an int" in messages[1], messages[1]
    assert "rank 0 is in call #" in messages[1] and "(combine)" in messages[1], messages[1]
