"""Low-latency calls of different kinds never pair on the device, even without a host agreement.

CUDA-graph replays make no host agreement. Every rank captures a lone dispatch (graph D) and a
lone combine of it (graph C), replays both once together, then rank 1 replays C while every
other rank replays D. Each kind's signals carry its own number (``ControlBlock``: a combine's
weights and partial flags carry ``combine_seq``, not the dispatch's number, which a repeated
combine used to find already set and sum stale partials with): rank 1's combine waits for
weights its peers never send, their dispatch for counts rank 1 never sends, and every rank's
next call raises, naming a peer, after the short kernel timeout. Before, rank 1's combine
completed silently with the previous replay's partials.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_utils import gpu_world_size, run_distributed
from moe_helpers import cuda_routing, nvshmem_built

KERNEL_TIMEOUT_S = 4.0


def _kinds_worker(rank: int, world: int) -> dict[str, Any]:
    import ep_backend as ep

    side = dist.new_group(backend="gloo")
    group = dist.new_group(backend="ep")
    ep.get_backend(group).options.kernel_timeout_s = KERNEL_TIMEOUT_S  # graphs keep it
    m, hidden, experts = 32, 512, 8 * world
    x, idx, w = cuda_routing(m, hidden, experts, 4, seed=rank)
    for _ in range(2):  # the NVSHMEM runtime at its size, outside capture
        d = ep.low_latency_dispatch(x, idx, m, experts, use_fp8=False, group=group)
        ep.low_latency_combine(d.recv_x, idx, w, d.handle, group=group)
    torch.cuda.synchronize()
    graph_d, graph_c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_d):
        d = ep.low_latency_dispatch(x, idx, m, experts, use_fp8=False, group=group)
    with torch.cuda.graph(graph_c):
        out = ep.low_latency_combine(d.recv_x, idx, w, d.handle, group=group)
    graph_d.replay()
    graph_c.replay()
    torch.cuda.synchronize()
    together = out.clone()
    dist.barrier(group=side)
    (graph_c if rank == 1 else graph_d).replay()
    torch.cuda.synchronize()  # the kernels end by their timeout
    result: dict[str, Any] = {
        "transport": ep.get_backend(group).low_latency_transport,
        "finite": bool(torch.isfinite(together.float()).all()),
    }
    try:
        ep.low_latency_dispatch(x, idx, m, experts, use_fp8=False, group=group)
        result["next_call"] = "no error"
    except Exception as exc:  # recorded for the parent
        result["next_call"] = f"{type(exc).__name__}: {exc}"
    dist.barrier(group=side)
    ep.abort(group)
    return result


@pytest.mark.gpu(min_gpus=2)
def test_replays_of_different_kinds_time_out_naming_the_peer_instead_of_summing() -> None:
    if not nvshmem_built():
        pytest.skip("libep_nvshmem.so was not built: the low-latency ops run on ATen")
    res = run_distributed(_kinds_worker, gpu_world_size(), backend="ep", timeout=240)
    for rank, r in enumerate(res):
        assert r["transport"] == "nvshmem", r
        assert r["finite"], r
        message = r["next_call"]
        assert "timed out" in message and "waiting for rank" in message, (rank, message)
    # Rank 1's combine waits for weights from every peer at once: any of them may be named
    # first (rank 0 is its only peer at 2 ranks). The dispatchers wait for rank 1's counts.
    named = re.search(r"waiting for rank (\d+)", res[1]["next_call"])
    assert named is not None and int(named.group(1)) != 1, res[1]["next_call"]
    if len(res) == 2:
        assert "waiting for rank 0" in res[1]["next_call"], res[1]["next_call"]
    for rank in (0, *range(2, len(res))):
        assert "waiting for rank 1" in res[rank]["next_call"], (rank, res[rank]["next_call"])
