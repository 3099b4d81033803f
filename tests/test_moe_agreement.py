"""The per-call cross-rank agreement of the MoE collectives: shared memory on one host, Gloo else,
or a transport's own gather (the internode transport's GPU exchange).

Every other MoE test runs over the shared-memory exchange (all test ranks share this host); this
file checks which transport was chosen and that the Gloo fallback and a transport's gather (here
the store-backed test gather) give the same results and the same collective rejection of bad
input.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed


def _round_trip_exact(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, **kwargs) -> bool:
    """One dispatch + combine through ep equals the reference bitwise (6 experts)."""
    import ep_backend as ep
    from ep_backend import reference as ref

    a = ep.dispatch(x, idx, w, 6, **kwargs)
    b = ref.dispatch(x, idx, w, 6, **kwargs)
    c = ep.combine(a.recv_x, a.handle, a.recv_topk_weights)
    d = ref.combine(b.recv_x, b.handle, b.recv_topk_weights)
    return (
        torch.equal(a.recv_x, b.recv_x)
        and torch.equal(a.recv_topk_idx, b.recv_topk_idx)
        and a.num_recv_tokens_per_expert_list == b.num_recv_tokens_per_expert_list
        and torch.equal(c.combined_x, d.combined_x)
    )


def _rejected_then_exact(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, spoil: bool):
    """A dispatch whose topk_idx holds an out-of-range id on this rank if ``spoil`` (valid
    elsewhere), then a valid one: (the first's error message, "" if none; whether the second
    equals the reference bitwise)."""
    import ep_backend as ep
    from ep_backend import reference as ref

    bad = idx.clone()
    if spoil:
        bad[0, 0] = 99
    try:
        ep.dispatch(x, bad, w, 6)
        raised = ""
    except RuntimeError as exc:
        raised = str(exc)
    return raised, torch.equal(ep.dispatch(x, idx, w, 6).recv_x, ref.dispatch(x, idx, w, 6).recv_x)


def _transport_and_results(rank: int, world: int) -> dict:
    import ep_backend as ep

    backend = ep.get_backend()
    before = backend.moe_agreement_transport
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(37 + 11 * rank, 64, generator=g).bfloat16()
    idx = torch.randint(-1, 6, (x.shape[0], 3), generator=g)
    w = torch.rand(x.shape[0], 3, generator=g)
    exact = True
    for _ in range(50):  # many calls: both parities of the exchange, many times over
        exact &= _round_trip_exact(x, idx, w)
    raised, after_bad_exact = _rejected_then_exact(x, idx, w, spoil=rank == 1)
    exact &= after_bad_exact
    sub = dist.new_group([0, 1])
    sub_transport = None
    if rank < 2:
        ep.dispatch(x, idx, w, 6, group=sub)
        sub_transport = ep.get_backend(sub).moe_agreement_transport
    return {"before": before, "after": backend.moe_agreement_transport, "exact": exact,
            "raised": raised, "sub": sub_transport}  # fmt: skip


@pytest.mark.parametrize(("env", "expected"), [({}, "shared memory"),
                                               ({"EP_HOST_EXCHANGE": "gloo"}, "gloo")])  # fmt: skip
def test_agreement_transport_and_equal_results(env: dict, expected: str) -> None:
    res = run_distributed(_transport_and_results, 3, backend="ep", env=env)
    for rank, r in enumerate(res):
        assert r["before"] == "undecided"
        assert r["after"] == expected, r
        assert r["exact"], rank
        if rank == 1:
            assert "topk_idx values must be in [-1" in r["raised"], r["raised"]
        else:
            assert "rank(s) 1 rejected their inputs" in r["raised"], r["raised"]
        assert r["sub"] == (expected if rank < 2 else None)


def _one_rank(rank: int, world: int) -> dict:
    import ep_backend as ep

    g = torch.Generator().manual_seed(11)
    x = torch.randn(41, 64, generator=g).bfloat16()
    idx = torch.randint(-1, 6, (41, 3), generator=g)
    w = torch.rand(41, 3, generator=g)
    exact = True
    for kwargs in ({}, {"num_worst_tokens": 64}, {"expert_alignment": 4}):
        exact &= _round_trip_exact(x, idx, w, **kwargs)
    raised, after_bad_exact = _rejected_then_exact(x, idx, w, spoil=True)
    exact &= after_bad_exact
    return {"transport": ep.get_backend().moe_agreement_transport, "exact": exact, "raised": raised}


def test_a_group_of_one_rank_needs_no_agreement() -> None:
    """A group of one rank (expert parallelism of 1) skips the per-call exchange (Gloo's
    round trip to its worker thread cost 100-400 µs per call there) and still checks its input."""
    (r,) = run_distributed(_one_rank, 1, backend="ep")
    assert r["transport"] == "none (one rank)", r
    assert r["exact"], r
    assert "topk_idx values must be in [-1" in r["raised"], r["raised"]


def _through_a_transport_gather(rank: int, world: int) -> dict:
    """The agreement through a transport's own RowGather (the path the internode transport's GPU
    exchange takes), here the store-backed test gather: the same results, the same collective
    rejection, and a rank that never joins a call named by the others."""
    import datetime
    import time

    import ep_backend as ep

    backend = ep.get_backend()
    backend._use_store_row_gather()  # every rank, before its first MoE call
    g = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(29 + 7 * rank, 64, generator=g).bfloat16()
    idx = torch.randint(-1, 6, (x.shape[0], 3), generator=g)
    w = torch.rand(x.shape[0], 3, generator=g)
    exact = True
    for _ in range(5):  # the gathers' keys of two calls back are dropped as they go
        exact &= _round_trip_exact(x, idx, w)
    raised, after_bad_exact = _rejected_then_exact(x, idx, w, spoil=rank == 1)
    exact &= after_bad_exact
    transport = backend.moe_agreement_transport
    backend.set_timeout(datetime.timedelta(seconds=3))
    absent = ""
    if rank == world - 1:
        time.sleep(6)  # alive, but never joins the next call
    else:
        try:
            ep.dispatch(x, idx, w, 6)
        except RuntimeError as exc:
            absent = str(exc)
    return {"transport": transport, "exact": exact, "raised": raised, "absent": absent}


def test_the_agreement_through_a_transport_gather() -> None:
    res = run_distributed(_through_a_transport_gather, 3, backend="ep")
    for rank, r in enumerate(res):
        assert r["transport"] == "store", r
        assert r["exact"], rank
        if rank == 1:
            assert "topk_idx values must be in [-1" in r["raised"], r["raised"]
        else:
            assert "rank(s) 1 rejected their inputs" in r["raised"], r["raised"]
        if rank < 2:
            assert "rank(s) 2 never joined it" in r["absent"], r["absent"]
