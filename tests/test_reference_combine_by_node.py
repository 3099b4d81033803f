"""reference.combine_by_node: the summation order of the hierarchical internode combine (per-node
float32 partials, then the nodes in order). With one rank per node it is bitwise ``combine``;
with several ranks per node it equals a float64 sum within float32 rounding, and both combines
agree on which tokens get rows (CPU, Gloo)."""

from __future__ import annotations

import torch
from _dist_utils import run_distributed


def _combine_both(rank: int, world: int, node_of_rank: list[int]) -> dict:
    from ep_backend import reference as ref

    g = torch.Generator().manual_seed(100 + rank)
    tokens, hidden, experts, topk = 40, 64, 4 * world, 3
    idx = torch.rand(tokens, experts, generator=g).topk(topk).indices
    idx[torch.rand(tokens, topk, generator=g) < 0.2] = -1
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w = torch.rand(tokens, topk, generator=g)
    out = ref.dispatch(x, idx, w, experts)
    y = (out.recv_x.float() * 1.7).bfloat16()
    bias = torch.randn(tokens, hidden, generator=g)
    flat = ref.combine(y, out.handle, out.recv_topk_weights, bias)
    by_node = ref.combine_by_node(y, out.handle, node_of_rank, out.recv_topk_weights, bias)
    exact = ref.combine(y.double(), out.handle, out.recv_topk_weights, bias.double())
    return {
        "flat": flat.combined_x,
        "by_node": by_node.combined_x,
        "flat_w": flat.combined_topk_weights,
        "by_node_w": by_node.combined_topk_weights,
        "exact": exact.combined_x,
    }


def test_one_rank_per_node_is_the_rank_order() -> None:
    for r in run_distributed(_combine_both, 4, [0, 1, 2, 3], backend="gloo"):
        assert torch.equal(r["flat"], r["by_node"])
        assert torch.equal(r["flat_w"], r["by_node_w"])


def test_two_ranks_per_node_sums_the_same_rows() -> None:
    for r in run_distributed(_combine_both, 4, [0, 0, 1, 1], backend="gloo"):
        # float32 accumulation cast to BF16: within one BF16 rounding of the float64 sum.
        assert torch.allclose(r["by_node"].double(), r["exact"], rtol=2**-7, atol=1e-5)
        assert torch.allclose(r["by_node_w"], r["flat_w"], rtol=1e-6, atol=1e-6)


def _bad_arguments(rank: int, world: int) -> dict:
    """Each bad argument raises on every rank before any row is exchanged; then a valid call
    still works (no rank was left inside the exchange)."""
    from ep_backend import reference as ref

    g = torch.Generator().manual_seed(7 + rank)
    tokens, hidden, experts = 8, 16, 2 * world
    idx = torch.randint(0, experts, (tokens, 2), generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    out = ref.dispatch(x, idx, torch.rand(tokens, 2, generator=g), experts)
    y = out.recv_x
    nodes = list(range(world))
    raised = {}
    cases = {
        "node_of_rank": lambda: ref.combine_by_node(y, out.handle, nodes[:-1]),
        "bias": lambda: ref.combine_by_node(
            y, out.handle, nodes, bias=torch.zeros(tokens + 1, hidden)
        ),
        "dtype": lambda: ref.combine_by_node(y.double(), out.handle, nodes),
        "rows": lambda: ref.combine_by_node(y[1:], out.handle, nodes),
    }
    for name, call in cases.items():
        try:
            call()
            raised[name] = ""
        except AssertionError as exc:
            raised[name] = str(exc)
    good = ref.combine_by_node(y, out.handle, nodes)
    return {
        "raised": raised,
        "good": good.combined_x,
        "flat": ref.combine(y, out.handle).combined_x,
    }


def test_bad_arguments_raise_on_every_rank_before_the_exchange() -> None:
    for r in run_distributed(_bad_arguments, 2, backend="gloo"):
        assert "node_of_rank" in r["raised"]["node_of_rank"]
        assert "bias" in r["raised"]["bias"]
        assert "BF16 or float32" in r["raised"]["dtype"]
        assert "x must be" in r["raised"]["rows"]
        assert torch.equal(r["good"], r["flat"])
