"""Per-node token counts of a layout (DeepEP's ``num_tokens_per_rdma_rank``): the reference
against a brute-force count, and ep's layout and the deep_ep facade against the reference on a
group of emulated nodes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

from ep_backend import reference as ref


def _brute_force(topk_idx: torch.Tensor, experts_per_rank: int, node_of_rank: list[int]) -> list:
    counts = [0] * (max(node_of_rank) + 1)
    for row in topk_idx.tolist():
        nodes = {node_of_rank[e // experts_per_rank] for e in row if e >= 0}
        for n in nodes:
            counts[n] += 1
    return counts


@pytest.mark.parametrize(
    "node_of_rank",
    [[0, 0, 0, 0], [0, 1], [0, 0, 1, 1], [0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 0, 1, 1, 1]],
)
def test_reference_counts_each_token_once_per_node(node_of_rank: list[int]) -> None:
    g = torch.Generator().manual_seed(3)
    ranks = len(node_of_rank)
    experts = 3 * ranks
    idx = torch.randint(-1, experts, (57, 4), generator=g)
    idx[5] = -1  # a token with no expert counts nowhere
    layout = ref.get_dispatch_layout(idx, experts, ranks, node_of_rank)
    expected = _brute_force(idx, 3, node_of_rank)
    assert layout.num_tokens_per_node.dtype == torch.int32
    assert layout.num_tokens_per_node.tolist() == expected
    # A token in two ranks of one node counts once there: never above the per-rank sums.
    for n, c in enumerate(expected):
        ranks_n = [r for r in range(ranks) if node_of_rank[r] == n]
        assert c <= int(layout.num_tokens_per_rank[ranks_n].sum())


def test_reference_default_is_one_node() -> None:
    idx = torch.tensor([[0, 5], [-1, -1], [3, -1]])
    assert ref.get_dispatch_layout(idx, 6, 2).num_tokens_per_node.tolist() == [2]


def test_reference_rejects_a_node_map_of_another_size() -> None:
    with pytest.raises(ValueError, match="node_of_rank names 3 ranks, the layout has 2"):
        ref.tokens_per_node(torch.zeros(4, 2, dtype=torch.bool), [0, 0, 1])


def _layouts(rank: int, world: int, k: int) -> dict:
    import ep_backend as ep
    from ep_backend import deep_ep

    group = dist.new_group(
        list(range(world)), backend="ep", pg_options=ep.Options(ranks_per_node=k)
    )
    nodes = ep.topology(group).node_of_rank
    g = torch.Generator().manual_seed(17 + rank)
    idx = torch.randint(-1, 2 * world, (31, 3), generator=g)
    mine = ep.get_dispatch_layout(idx, 2 * world, group=group).num_tokens_per_node
    spec = ref.get_dispatch_layout(idx, 2 * world, world, nodes).num_tokens_per_node
    per_rdma_rank = deep_ep.Buffer(group).get_dispatch_layout(idx, 2 * world)[1]
    world_layout = ep.get_dispatch_layout(idx, 2 * world).num_tokens_per_node
    return {"mine": mine, "spec": spec, "facade": per_rdma_rank, "world": world_layout,
            "any": int((idx >= 0).any(dim=1).sum())}  # fmt: skip


@pytest.mark.parametrize(("world", "k"), [(2, 1), (4, 2), (4, 1)])
def test_ep_layout_and_facade_match_the_reference(world: int, k: int) -> None:
    for r in run_distributed(_layouts, world, k, backend="ep"):
        assert r["mine"].shape == (world // k,)
        assert torch.equal(r["mine"], r["spec"])
        assert r["facade"] is not None and torch.equal(r["facade"], r["spec"])
        # The WORLD group (no emulation) is one node: every token with an expert, once.
        assert r["world"].tolist() == [r["any"]]
