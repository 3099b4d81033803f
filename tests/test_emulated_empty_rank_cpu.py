"""CPU: the internode spec's call sequence with an empty rank, on emulated nodes (2 x 1), and the
empty-rank phases of the GPU test (rank 0, then rank 1, then every rank with T = 0).

With ``EP_RANKS_PER_NODE=1`` the per-call agreement goes through Gloo, as across hosts, and the
reference's exchanges share that Gloo backend with it. The GPU spec test
(``tests/test_internode_emulation_gpu.py``) once hung in its "empty" case (rank 0 sends nothing);
this runs the same sequence of MoE calls and reference calls on CPU tensors, so that the host side
(agreement through Gloo with an empty rank, layouts of zero tokens, the reference's collectives)
is known to complete and to equal the reference, and a hang there would show up without a GPU.
"""

from __future__ import annotations

import torch
from _dist_utils import run_distributed

H, K = 128, 8


def _routing(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    idx = torch.rand(tokens, experts, generator=g).topk(K).indices
    idx[torch.rand(tokens, K, generator=g) < 0.1] = -1
    return x, idx, torch.rand(tokens, K, generator=g)


def _empty_rank_sequence(rank: int, world: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    failures: list[str] = []
    steps = 0

    def same(name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        if (got is None) != (want is None) or (got is not None and not torch.equal(got, want)):
            failures.append(name)

    for tag, tokens in (("full", 40), ("empty", 0 if rank == 0 else 33)):
        x, idx, w = _routing(tokens, experts, seed=rank * 11 + tokens)
        layout = ep.get_dispatch_layout(idx, experts)
        for with_layout in (False, True):
            a = ep.dispatch(x, idx, w, experts, expert_alignment=4,
                            layout=layout if with_layout else None)  # fmt: skip
            b = ref.dispatch(x, idx, w, experts, expert_alignment=4)
            same(f"{tag} layout={with_layout} recv_x", a.recv_x, b.recv_x)
            same(f"{tag} layout={with_layout} recv_topk_idx", a.recv_topk_idx, b.recv_topk_idx)
            steps += 1
        y = (a.recv_x.float() * 3 - 1).bfloat16()
        same(f"{tag} combine", ep.combine(y, a.handle, a.recv_topk_weights).combined_x,
             ref.combine(y, b.handle, b.recv_topk_weights).combined_x)  # fmt: skip
        x2 = torch.randn_like(x.float()).bfloat16()
        same(f"{tag} cached", ep.dispatch(x2, handle=a.handle).recv_x,
             ref.dispatch(x2, handle=b.handle).recv_x)  # fmt: skip
        aw = ep.dispatch(x, idx, w, experts, num_worst_tokens=64 * world)
        bw = ref.dispatch(x, idx, w, experts, num_worst_tokens=64 * world)
        same(f"{tag} worst recv_x", aw.recv_x, bw.recv_x)
        steps += 3
    backend = ep.get_backend()
    return {"failures": failures, "steps": steps, "agreement": backend.moe_agreement_transport}


def test_empty_rank_sequence_on_emulated_nodes_completes_and_matches() -> None:
    results = run_distributed(
        _empty_rank_sequence, 2, backend="ep", timeout=120.0, env={"EP_RANKS_PER_NODE": "1"}
    )
    for rank, r in enumerate(results):
        assert r["agreement"] == "gloo", (rank, r["agreement"])
        assert r["steps"] == 10, (rank, r["steps"])
        assert r["failures"] == [], (rank, r["failures"])


# The phases of the GPU test test_internode_empty_ranks_match_the_reference: rank 0 empty, then
# rank 1, then every rank (None).
PHASES = (("rank 0 empty", (0,)), ("rank 1 empty", (1,)), ("all empty", None))


def _empty_phases(rank: int, world: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    nodes = ep.topology().node_of_rank
    failures: list[str] = []
    calls = 0
    for phase, (tag, empty) in enumerate(PHASES):
        tokens = 0 if empty is None or rank in empty else 29 + 5 * rank
        x, idx, w = _routing(tokens, experts, seed=1000 * phase + rank)
        layout = ep.get_dispatch_layout(idx, experts)
        for with_layout in (False, True):
            name = f"{tag} layout={with_layout}"
            a = ep.dispatch(x, idx, w, experts, expert_alignment=4,
                            layout=layout if with_layout else None)  # fmt: skip
            b = ref.dispatch(x, idx, w, experts, expert_alignment=4)
            for field in ("recv_x", "recv_topk_idx", "recv_topk_weights",
                          "num_recv_tokens_per_expert"):  # fmt: skip
                if not torch.equal(getattr(a, field), getattr(b, field)):
                    failures.append(f"{name} {field}")
            y = (a.recv_x.float() * 3 - 1).bfloat16()
            got = ep.combine(y, a.handle, a.recv_topk_weights)
            want = ref.combine_by_node(y, b.handle, nodes, b.recv_topk_weights)
            flat = ref.combine(y, b.handle, b.recv_topk_weights)
            if not torch.equal(want.combined_x, flat.combined_x):  # one rank per node
                failures.append(f"{name} combine_by_node != combine")
            if not torch.equal(got.combined_x, flat.combined_x):
                failures.append(f"{name} combine")
            if got.combined_x.shape != (tokens, H):
                failures.append(f"{name} combine shape {tuple(got.combined_x.shape)}")
            calls += 2
    return {"failures": failures, "calls": calls}


def test_empty_rank_phases_on_emulated_nodes_complete_and_match() -> None:
    """Rank 0 empty, rank 1 empty, then every rank empty: two dispatches (with and without a
    layout) and a combine each, on CPU: the host side and the reference of the GPU test
    test_internode_empty_ranks_match_the_reference."""
    results = run_distributed(
        _empty_phases, 2, backend="ep", timeout=120.0, env={"EP_RANKS_PER_NODE": "1"}
    )
    for rank, r in enumerate(results):
        assert r["calls"] == 12, (rank, r["calls"])
        assert r["failures"] == [], (rank, r["failures"])
