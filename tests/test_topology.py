"""The group's nodes (ep_backend._topology): found from the ranks' hosts at group creation, or
emulated by ``Options(ranks_per_node=k)`` / ``EP_RANKS_PER_NODE``; invalid requests raise on
every rank; emulated nodes agree through Gloo, as separate hosts must."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

from ep_backend._topology import Topology, plan_topology, requested_ranks_per_node


def test_one_host_is_one_node() -> None:
    t = plan_topology(["a"] * 4)
    assert (t.num_nodes, t.ranks_per_node, t.emulated, t.problem) == (1, 4, False, "")
    assert t.node_of_rank == (0, 0, 0, 0)
    assert t.local_rank == (0, 1, 2, 3)


def test_hosts_become_nodes_numbered_by_lowest_rank() -> None:
    t = plan_topology(["b", "a", "b", "a"])
    assert (t.num_nodes, t.ranks_per_node, t.problem) == (2, 2, "")
    assert t.node_of_rank == (0, 1, 0, 1)
    assert t.local_rank == (0, 0, 1, 1)
    assert t.ranks_of_node(1) == [1, 3]


def test_unequal_or_oversized_hosts_are_reported_not_raised() -> None:
    t = plan_topology(["a", "a", "a", "b"])
    assert t.num_nodes == 2 and t.ranks_per_node == 0
    assert "unequal numbers of ranks ([3, 1])" in t.problem
    t = plan_topology(["a"] * 9 + ["b"] * 9)
    assert t.ranks_per_node == 9 and "at most 8 per node" in t.problem
    # One host of many ranks is one node: the intranode path decides what it serves.
    assert plan_topology(["a"] * 16).problem == ""


@pytest.mark.parametrize(("size", "k", "nodes"), [(2, 1, 2), (4, 2, 2), (4, 1, 4), (8, 4, 2)])
def test_emulation_splits_one_host(size: int, k: int, nodes: int) -> None:
    t = plan_topology(["h"] * size, k)
    assert (t.num_nodes, t.ranks_per_node, t.emulated) == (nodes, k, nodes > 1)
    assert t.node_of_rank == tuple(r // k for r in range(size))
    assert t.local_rank == tuple(r % k for r in range(size))


def test_emulation_matching_the_hosts_is_not_emulated() -> None:
    t = plan_topology(["a", "a", "b", "b"], 2)
    assert t.num_nodes == 2 and not t.emulated


@pytest.mark.parametrize(
    ("hosts", "k", "message"),
    [
        (["h"] * 4, 3, "ranks_per_node=3 does not divide the group's 4 ranks"),
        (["h"] * 4, 9, "must be 0 (find the nodes from the hosts) or in [1, 8], got 9"),
        (["h"] * 4, -1, "got -1"),
        (["a", "b", "b", "b"], 2, "puts ranks 0 and 1 in one node, but they run on different"),
    ],
)
def test_emulation_requests_that_cannot_be_honoured_raise(
    hosts: list[str], k: int, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_topology(hosts, k)


def test_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EP_RANKS_PER_NODE", raising=False)
    assert requested_ranks_per_node(0) == 0
    monkeypatch.setenv("EP_RANKS_PER_NODE", "2")
    assert requested_ranks_per_node(0) == 2
    assert requested_ranks_per_node(4) == 4  # the option wins
    monkeypatch.setenv("EP_RANKS_PER_NODE", "x")
    with pytest.raises(ValueError, match="EP_RANKS_PER_NODE must be an integer"):
        requested_ranks_per_node(0)
    monkeypatch.setenv("EP_RANKS_PER_NODE", "9")
    with pytest.raises(ValueError, match=r"EP_RANKS_PER_NODE must be in \[0, 8\]"):
        requested_ranks_per_node(0)


def test_options_validate_ranks_per_node() -> None:
    import ep_backend as ep

    assert ep.Options().ranks_per_node == 0
    assert ep.Options(ranks_per_node=4).ranks_per_node == 4
    assert "ranks_per_node=4" in repr(ep.Options(ranks_per_node=4))
    with pytest.raises(RuntimeError, match="ranks_per_node must be 0"):
        ep.Options(ranks_per_node=9)
    opts = ep.Options()
    with pytest.raises(RuntimeError, match="ranks_per_node must be 0"):
        opts.ranks_per_node = -1


def _group_topology(rank: int, world: int, k: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    group = dist.new_group(
        list(range(world)), backend="ep", pg_options=ep.Options(ranks_per_node=k)
    )
    t_world = ep.topology()
    t = ep.topology(group)
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(23, 32, generator=g).bfloat16()
    idx = torch.randint(-1, 4 * world, (23, 3), generator=g)
    w = torch.rand(23, 3, generator=g)
    a = ep.dispatch(x, idx, w, 4 * world, group=group)
    b = ref.dispatch(x, idx, w, 4 * world, group=group)
    c = ep.combine(a.recv_x, a.handle, a.recv_topk_weights, group=group)
    d = ref.combine(b.recv_x, b.handle, b.recv_topk_weights, group=group)
    exact = torch.equal(a.recv_x, b.recv_x) and torch.equal(c.combined_x, d.combined_x)
    return {"world": t_world, "group": t, "exact": exact,
            "agreement": ep.get_backend(group).moe_agreement_transport}  # fmt: skip


def test_emulated_nodes_on_a_cpu_group() -> None:
    res = run_distributed(_group_topology, 4, 2, backend="ep")
    for r in res:
        assert r["world"] == Topology(1, 4, (0, 0, 0, 0), (0, 1, 2, 3))
        assert r["group"] == Topology(2, 2, (0, 0, 1, 1), (0, 1, 0, 1), emulated=True)
        assert r["exact"]
        # Emulated nodes agree through Gloo, as different hosts would.
        assert r["agreement"] == "gloo"


def _world_topology(rank: int, world: int) -> Topology:
    import ep_backend as ep

    return ep.topology()


def test_environment_emulates_nodes_for_every_group() -> None:
    res = run_distributed(_world_topology, 2, backend="ep", env={"EP_RANKS_PER_NODE": "1"})
    assert res == [Topology(2, 1, (0, 1), (0, 0), emulated=True)] * 2


def _one_rank_group(rank: int, world: int) -> Topology:
    import ep_backend as ep

    group = dist.new_group([0], backend="ep")  # collective: every rank calls it
    return ep.topology(group) if rank == 0 else None


def test_a_group_of_one_rank_is_one_node_whatever_the_request() -> None:
    res = run_distributed(_one_rank_group, 2, backend="ep", env={"EP_RANKS_PER_NODE": "2"})
    assert res[0] == Topology(1, 1, (0,), (0,))


def _bad_group(rank: int, world: int) -> str:
    import ep_backend as ep

    try:
        dist.new_group(list(range(world)), backend="ep", pg_options=ep.Options(ranks_per_node=2))
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_request_that_cannot_be_honoured_raises_on_every_rank() -> None:
    res = run_distributed(_bad_group, 3, backend="ep")
    assert all("ranks_per_node=2 does not divide the group's 3 ranks" in m for m in res), res
