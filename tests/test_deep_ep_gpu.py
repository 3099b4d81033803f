"""``ep_backend.deep_ep`` on GPUs: DeepEP-style code on the intranode (NVLink) and low-latency
(NVSHMEM, where built) paths, one rank per GPU, on a NCCL world (as Megatron's expert group)
and on an ``"ep"`` world. Same cases as the CPU test (``deep_ep_cases.py``); small shapes,
seconds per run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import gpu_world_size, run_distributed

import ep_backend.deep_ep as facade

TIMEOUT = 300.0


def _gpu_cases_worker(rank: int, world: int, seed: int) -> tuple[str, str, str]:
    facade.install()
    import deep_ep
    import deep_ep_cases

    device = torch.device("cuda", torch.cuda.current_device())
    deep_ep_cases.case_normal(rank, world, device, seed)
    deep_ep_cases.case_low_latency(rank, world, device, seed)
    buffer = deep_ep.Buffer(dist.group.WORLD)
    stream = buffer.get_comm_stream()
    assert isinstance(stream, torch.cuda.Stream) and stream != torch.cuda.current_stream()
    backend = facade.Buffer(dist.group.WORLD)._backend
    return (
        dist.get_backend(buffer.ep_group),
        backend.high_throughput_transport,
        backend.low_latency_transport,
    )


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("world_backend", ["cpu:gloo,cuda:nccl", "ep"])
def test_deepep_code_runs_unchanged_on_gpus(world_backend: str) -> None:
    world = min(gpu_world_size(), torch.cuda.device_count())
    results = run_distributed(_gpu_cases_worker, world, 5, backend=world_backend, timeout=TIMEOUT)
    for group_backend, high_throughput, _low_latency in results:
        assert group_backend == "ep"
        assert high_throughput == "nvlink", high_throughput
