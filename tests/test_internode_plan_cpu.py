"""CPU: the internode transport's host planning (native/transports/internode/internode_plan.hpp)
with empty ranks: a rank with T = 0, one that sends nothing off its node, one that receives
nothing, and calls where every rank is empty.

``_internode_plan`` is the plan the dispatch kernels get (slot of each row at each receiver,
position of each token among those sent to each node, tokens per node). The test replays what
the kernels do with it (pack one record per token and destination node, the RDMA leg to the
forwarder with the source's local index, the forwarder's NVLink writes at the slots) and checks
each receiver's rows against the dispatch contract (source rank, then source token), every slot
written exactly once, and that every (source, node) pair has a count to signal, 0 included.
``_internode_capacity`` sizes the symmetric buffers from agreed values: a call where every rank
is empty still gets positive buffers, and later calls rebuild only when a row or count grows.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import ep_backend as ep
from ep_backend import reference as ref

K = 4

# (num_nodes, ranks_per_node, node_of_rank): the emulated topologies of the GPU tests, and a
# group whose ranks alternate between nodes (the node table is not the rank order).
TOPOLOGIES = [
    pytest.param(2, 1, (0, 1), id="2x1"),
    pytest.param(2, 2, (0, 0, 1, 1), id="2x2"),
    pytest.param(4, 1, (0, 1, 2, 3), id="4x1"),
    pytest.param(2, 2, (0, 1, 0, 1), id="2x2-interleaved"),
]

# Tokens per rank (None: a random count in [1, 40]) and a routing rule per scenario.
SCENARIOS = ["rank0 empty", "rank1 empty", "all empty", "rank0 stays on its node",
             "last rank receives nothing", "full"]  # fmt: skip


def _node_table(node_of_rank: tuple[int, ...], num_nodes: int, per_node: int) -> list[int]:
    """Global rank of (node n, local l) at n * per_node + l; local = rank order inside a node."""
    table = [-1] * (num_nodes * per_node)
    seen = [0] * num_nodes
    for r, n in enumerate(node_of_rank):
        table[n * per_node + seen[n]] = r
        seen[n] += 1
    assert -1 not in table
    return table


def _routing(scenario: str, rank: int, world: int, node_of_rank: tuple[int, ...],
             experts: int, g: torch.Generator) -> torch.Tensor:  # fmt: skip
    """topk_idx int64 [T, K] of `rank` in `scenario`."""
    per_rank = experts // world
    empty = {"rank0 empty": rank == 0, "rank1 empty": rank == 1, "all empty": True}
    tokens = 0 if empty.get(scenario, False) else int(torch.randint(1, 41, (1,), generator=g))
    allowed = list(range(experts))
    if scenario == "rank0 stays on its node" and rank == 0:
        allowed = [e for e in allowed if node_of_rank[e // per_rank] == node_of_rank[0]]
    if scenario == "last rank receives nothing":
        allowed = [e for e in allowed if e // per_rank != world - 1]
    if tokens == 0:
        return torch.empty(0, K, dtype=torch.long)
    pool = torch.tensor(allowed)
    idx = torch.stack([pool[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(tokens)])
    idx[torch.rand(tokens, K, generator=g) < 0.2] = -1
    return idx.long()


def _replay_dispatch(layouts: list, node_of_rank: tuple[int, ...], num_nodes: int,
                     per_node: int) -> tuple[list[dict[int, tuple[int, int]]], list[str]]:  # fmt: skip
    """Runs every rank's plan through the kernels' data movement; returns, per receiver, slot ->
    (source rank, source token), and the problems found on the way."""
    world = len(node_of_rank)
    table = _node_table(node_of_rank, num_nodes, per_node)
    local_of = {r: table.index(r) % per_node for r in range(world)}
    matrix = torch.stack([lay.is_token_in_rank.sum(0) for lay in layouts]).long()
    received: list[dict[int, tuple[int, int]]] = [{} for _ in range(world)]
    problems: list[str] = []
    for s, lay in enumerate(layouts):
        T = lay.is_token_in_rank.shape[0]
        dest_slot, node_pos, node_count = ep._C._internode_plan(
            lay.is_token_in_rank, lay.send_pos, matrix, s, table, num_nodes, per_node
        )
        if (tuple(dest_slot.shape), tuple(node_pos.shape), tuple(node_count.shape)) != (
            (T, world), (T, num_nodes), (num_nodes,)
        ):  # fmt: skip
            problems.append(f"rank {s}: plan shapes {dest_slot.shape} {node_pos.shape}")
            continue
        if dest_slot.dtype != torch.int32 or node_pos.dtype != torch.int32:
            problems.append(f"rank {s}: plan dtypes {dest_slot.dtype} {node_pos.dtype}")
        if not torch.equal(dest_slot >= 0, lay.is_token_in_rank):
            problems.append(f"rank {s}: dest_slot marks other ranks than is_token_in_rank")
        for n in range(num_nodes):
            # Pack: one record per token sent to node n, at its position; the count is what the
            # source signals to node n's forwarder (0 included: that forwarder waits for it).
            count = int(node_count[n])
            positions = node_pos[:, n][node_pos[:, n] >= 0].tolist()
            if sorted(positions) != list(range(count)):
                problems.append(f"rank {s} node {n}: positions {positions} for count {count}")
            ranks_n = [table[n * per_node + ell] for ell in range(per_node)]
            needed = lay.is_token_in_rank[:, ranks_n].any(1)
            if not torch.equal(node_pos[:, n] >= 0, needed):
                problems.append(f"rank {s} node {n}: records for other tokens than it needs")
            records = [t for t in range(T) if node_pos[t, n] >= 0]
            records.sort(key=lambda t: int(node_pos[t, n]))
            # The forwarder (node n, the source's local index) writes each record to the slots
            # of its node's ranks.
            forwarder = table[n * per_node + local_of[s]]
            assert node_of_rank[forwarder] == n
            for t in records:
                for d in ranks_n:
                    slot = int(dest_slot[t, d])
                    if slot < 0:
                        continue
                    if slot in received[d]:
                        problems.append(f"rank {d} slot {slot} written twice")
                    received[d][slot] = (s, t)
    return received, problems


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize(("num_nodes", "per_node", "node_of_rank"), TOPOLOGIES)
def test_plan_puts_every_row_at_its_reference_slot(
    num_nodes: int, per_node: int, node_of_rank: tuple[int, ...], scenario: str
) -> None:
    world = num_nodes * per_node
    experts = 4 * world
    g = torch.Generator().manual_seed(zlib.crc32(f"{node_of_rank} {scenario}".encode()))
    idx = [_routing(scenario, r, world, node_of_rank, experts, g) for r in range(world)]
    layouts = [ref.get_dispatch_layout(i, experts, world, node_of_rank) for i in idx]
    received, problems = _replay_dispatch(layouts, node_of_rank, num_nodes, per_node)
    assert problems == []
    for d in range(world):
        # The contract: rows by source rank, then source token.
        want = [(s, t) for s in range(world) for t in range(idx[s].shape[0])
                if bool(layouts[s].is_token_in_rank[t, d])]  # fmt: skip
        got = [received[d][slot] for slot in sorted(received[d])]
        assert sorted(received[d]) == list(range(len(want))), (d, sorted(received[d]))
        assert got == want, d
    if scenario == "all empty":
        assert all(not r for r in received)
    if scenario == "last rank receives nothing":
        assert received[world - 1] == {}


def test_plan_of_an_empty_rank_has_a_count_for_every_node() -> None:
    """T = 0: no rows, but a count (0) for every node, which its signal carries."""
    lay = ref.get_dispatch_layout(torch.empty(0, K, dtype=torch.long), 16, 4, (0, 0, 1, 1))
    matrix = torch.tensor([[0, 0, 0, 0], [3, 1, 0, 2], [0, 0, 0, 0], [1, 1, 1, 1]])
    dest_slot, node_pos, node_count = ep._C._internode_plan(
        lay.is_token_in_rank, lay.send_pos, matrix, 2, [0, 1, 2, 3], 2, 2
    )
    assert dest_slot.shape == (0, 4) and node_pos.shape == (0, 2)
    assert node_count.dtype == torch.int32 and node_count.tolist() == [0, 0]


def test_plan_rejects_a_node_table_that_does_not_match_the_group() -> None:
    lay = ref.get_dispatch_layout(torch.zeros(3, K, dtype=torch.long), 8, 2)
    with pytest.raises(RuntimeError, match="do not match a group of 2"):
        ep._C._internode_plan(lay.is_token_in_rank, lay.send_pos, torch.zeros(2, 2), 0,
                              [0, 1], 2, 2)  # fmt: skip


H = 512

# Fields of the capacity, in internode::Capacity's order.
TOKENS, RECV_ROWS, RECORD, OUT_RECORD, COMBINE_ROW, PARTIAL_ROW, LOCAL_EXPERTS = range(7)


def _dispatch(have: list[int], max_tokens: int, max_recv: int, element_bytes: int = 2,
              scale_bytes: int = 0, topk: int = 8, nodes: int = 2, per_node: int = 1,
              local_experts: int = 8):  # fmt: skip
    return ep._C._internode_capacity(have, "dispatch", max_tokens, max_recv, H, element_bytes,
                                     scale_bytes, topk, nodes, per_node, local_experts)  # fmt: skip


def _combine(have: list[int], max_tokens: int, element_bytes: int = 2, topk: int = 8):
    return ep._C._internode_capacity(have, "combine", max_tokens, 1, H, element_bytes, 0, topk,
                                     2, 1)  # fmt: skip


def test_first_call_where_every_rank_is_empty_gets_positive_buffers() -> None:
    rebuild, cap, region = _dispatch([], 0, 0)
    assert rebuild
    assert cap[TOKENS] >= 1 and cap[RECV_ROWS] >= 1  # the runtime refuses a zero capacity
    assert min(cap) > 0 and region > 0
    rebuild, cap_c, _ = _combine([], 0)
    assert rebuild and cap_c[TOKENS] >= 1 and cap_c[RECV_ROWS] >= 1


def test_the_spec_sequence_rebuilds_only_when_a_row_or_count_grows() -> None:
    """The GPU spec test's calls (T = 300, then 77, then an empty rank: agreed maxima 33 and
    0), as each rank computes them from agreed values: the same answer on every rank, so no rank
    builds (a collective NVSHMEM step) alone."""
    rebuild, cap, _ = _dispatch([], 300, 600)
    assert rebuild and cap[TOKENS] >= 300 and cap[RECV_ROWS] >= 600
    steps = [
        (_combine, (300,), False),  # BF16 rows of the same H, top-k: room kept by the dispatch
        (_combine, (300, 4, 0), True),  # float32 rows: a combine row grows
        (_dispatch, (300, 600, 1, 16, 8), False),  # FP8 with scales: smaller records
        (_dispatch, (77, 154), False),
        (_dispatch, (33, 66), False),  # rank 0 empty: the agreed maximum is rank 1's 33
        (_combine, (33,), False),
        (_dispatch, (0, 0), False),  # every rank empty
        (_combine, (0, 2, 0), False),
        (_dispatch, (2000, 4000), True),  # more tokens than the buffers hold
        (_dispatch, (33, 66, 2, 0, 8, 2, 1, 64), True),  # more experts per rank: wider notify rows
        (_combine, (33,), False),
        (_dispatch, (33, 66, 2, 0, 8, 2, 1, 16), False),
    ]
    for fn, args, want in steps:
        result = fn(cap, *args)
        rebuild, grown, _ = result
        assert rebuild == want, (fn.__name__, args)
        assert all(g >= c for g, c in zip(grown, cap, strict=True)), "capacity never shrinks"
        assert fn(cap, *args) == result, "a pure function of agreed values"
        cap = grown
    assert cap[TOKENS] >= 2000 and cap[RECV_ROWS] >= 4000 and cap[LOCAL_EXPERTS] >= 64


def test_capacity_rejects_malformed_arguments() -> None:
    with pytest.raises(RuntimeError, match="7 capacity fields"):
        ep._C._internode_capacity([1, 2], "dispatch", 1, 1, H, 2, 0, 8, 2, 1)
    with pytest.raises(RuntimeError, match="dispatch or combine"):
        ep._C._internode_capacity([], "gather", 1, 1, H, 2, 0, 8, 2, 1)
