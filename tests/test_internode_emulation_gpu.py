"""Emulated nodes on one host (``EP_RANKS_PER_NODE``): 2 GPUs as 2 nodes x 1, 4 GPUs as 2 x 2 and
4 x 1. Checks the topology each rank sees, that the NVLink transport declines the group (legs
between nodes must not take NVLink) with a reason naming the nodes, that the per-call agreement
goes through Gloo, and that dispatch (BF16, FP8), cached dispatch, combine and the layout's
per-node counts equal the reference. Until the internode transport exists these run on the
ATen + NCCL path; the same assertions on the results hold for it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _dist_utils import run_distributed
from moe_helpers import cuda_routing

pytestmark = pytest.mark.gpu(min_gpus=2)

H, K = 512, 8

TOPOLOGIES = [
    pytest.param(2, 1, id="2x1"),
    pytest.param(4, 2, id="2x2", marks=pytest.mark.gpu(min_gpus=4)),
    pytest.param(4, 1, id="4x1", marks=pytest.mark.gpu(min_gpus=4)),
]


def _emulated(rank: int, world: int, per_node: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    failures: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want.cpu()):
            failures.append(name)

    x, idx, w = cuda_routing(300, H, experts, K, seed=rank * 7 + 1)
    xc, idxc, wc = x.cpu(), idx.cpu(), w.cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ep.FallbackWarning)
        layout = ep.get_dispatch_layout(idx, experts)
        nodes = ep.topology().node_of_rank
        check("num_tokens_per_node", layout.num_tokens_per_node,
              ref.get_dispatch_layout(idxc, experts, world, nodes).num_tokens_per_node)  # fmt: skip
        a = ep.dispatch(x, idx, w, experts, layout=layout)
        b = ref.dispatch(xc, idxc, wc, experts)
        check("bf16 recv_x", a.recv_x, b.recv_x)
        check("bf16 recv_topk_idx", a.recv_topk_idx, b.recv_topk_idx)
        check("bf16 recv_topk_weights", a.recv_topk_weights, b.recv_topk_weights)
        if a.num_recv_tokens_per_expert_list != b.num_recv_tokens_per_expert_list:
            failures.append("per-expert counts")
        y = a.recv_x * 3
        check("combine", ep.combine(y, a.handle, a.recv_topk_weights).combined_x,
              ref.combine(y.cpu(), b.handle, b.recv_topk_weights).combined_x)  # fmt: skip
        x2 = x.flip(0).contiguous()
        cached = ep.dispatch(x2, handle=a.handle)
        check("cached recv_x", cached.recv_x, ref.dispatch(x2.cpu(), handle=b.handle).recv_x)
        x8, s8 = ref.quantize_fp8_per128(x.float())
        a8 = ep.dispatch(x8, idx, None, experts, x_scales=s8)
        b8 = ref.dispatch(x8.cpu(), idxc, None, experts, x_scales=s8.cpu())
        check("fp8 recv_x", a8.recv_x.view(torch.uint8), b8.recv_x.view(torch.uint8))
        check("fp8 scales", a8.recv_x_scales, b8.recv_x_scales)
    torch.cuda.synchronize()
    backend = ep.get_backend()
    return {"topology": ep.topology(), "failures": failures,
            "transport": backend.high_throughput_transport,
            "agreement": backend.moe_agreement_transport}  # fmt: skip


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_emulated_nodes_match_the_reference(world: int, per_node: int) -> None:
    import ep_backend as ep

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_distributed(
        _emulated, world, per_node, backend="ep", env={"EP_RANKS_PER_NODE": str(per_node)}
    )
    nodes = world // per_node
    for rank, r in enumerate(results):
        t = r["topology"]
        assert t == ep.Topology(
            nodes, per_node, tuple(q // per_node for q in range(world)),
            tuple(q % per_node for q in range(world)), emulated=True,
        ), (rank, t)  # fmt: skip
        assert r["failures"] == [], (rank, r["failures"])
        # Not NVLink across emulated nodes; the reason names the topology.
        assert r["transport"].startswith(
            f"aten: the group spans {nodes} nodes (emulated: ranks_per_node={per_node})"
        ), r["transport"]
        assert r["agreement"] == "gloo", r["agreement"]


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_low_latency_with_emulated_nodes(world: int, per_node: int) -> None:
    """The NVSHMEM low-latency kernels with emulated nodes: peers on other nodes take the put
    path (the runtime leaves them out of its P2P table), peers on the node keep P2P; results
    equal the reference (the checks of test_moe_gpu's low-latency test, which also requires
    the NVSHMEM transport wherever it is built)."""
    from test_moe_gpu import _ll_cuda

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_distributed(
        _ll_cuda, world, 1024, 8, 8 * world, backend="ep",
        env={"EP_RANKS_PER_NODE": str(per_node)},
    )  # fmt: skip
    for rank, failures in enumerate(results):
        assert failures == [], (rank, failures)
