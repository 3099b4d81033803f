"""vLLM's and SGLang's DeepEP call sequences (``deep_ep_replays.py``) against the facade.

CPU: on a Gloo world, as vLLM hands ``Buffer`` its CPU group. GPU (marked): on a NCCL world,
one rank per GPU. The MoE output must match the local computation within BF16 (or FP8)
round-off.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import gpu_world_size, run_distributed

import ep_backend.deep_ep as facade

TIMEOUT = 180.0


def _replay_worker(rank: int, world: int, device_type: str) -> list[str]:
    torch.set_num_threads(1)
    facade.install()
    import deep_ep
    import deep_ep_cases
    import deep_ep_replays as r

    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    if device_type == "cpu":
        device = torch.device("cpu")
    max_tokens, hidden = 16, 256
    x, idx, w, experts = deep_ep_cases.routing(
        rank, world, 21, device, num_tokens=6 + rank, hidden=hidden, experts_per_rank=2
    )
    want = r.expected_moe(x, idx, w)
    errors: list[str] = []

    def expect(name: str, got: torch.Tensor, tolerance: float) -> None:
        err = r.relative_error(got, want)
        if not err <= tolerance:
            errors.append(f"rank {rank} {name}: relative error {err:.4f} > {tolerance}")

    # vLLM: a high-throughput buffer on the given (Gloo/NCCL) group, a low-latency one.
    ht = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, low_latency_mode=False, num_qps_per_rank=1)
    expect("vllm ht bf16", r.vllm_high_throughput(ht, x, idx, w, experts, rank, False), 0.01)
    expect("vllm ht fp8", r.vllm_high_throughput(ht, x, idx, w, experts, rank, True), 0.08)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, experts)
    ll = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True,
                        num_qps_per_rank=experts // world)  # fmt: skip
    expect("vllm ll bf16", r.vllm_low_latency(ll, x, idx, w, experts, max_tokens, False), 0.01)
    expect("vllm ll fp8", r.vllm_low_latency(ll, x, idx, w, experts, max_tokens, True), 0.08)

    # SGLang auto mode: one buffer for both modes, normal then low-latency calls.
    sg = deep_ep.Buffer(dist.group.WORLD, int(1e9), hint, low_latency_mode=True,
                        num_qps_per_rank=max(deep_ep.Buffer.num_sms, experts // world),
                        allow_mnnvl=True)  # fmt: skip
    for async_finish, alignment in ((False, 1), (True, 128)):
        got = r.sglang_normal(sg, x, idx, w, experts, async_finish, alignment)
        expect(f"sglang normal async={async_finish}", got, 0.01)
    for use_fp8, hook in ((False, False), (True, True)):
        got = r.sglang_low_latency(sg, x, idx, w, experts, max_tokens, use_fp8, hook, True)
        expect(f"sglang ll fp8={use_fp8} hook={hook}", got, 0.08 if use_fp8 else 0.01)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_framework_replays_cpu(world: int) -> None:
    results = run_distributed(_replay_worker, world, "cpu", backend="gloo", timeout=TIMEOUT)
    assert results == [[]] * world, results


@pytest.mark.gpu(min_gpus=2)
def test_framework_replays_gpu() -> None:
    world = min(gpu_world_size(), torch.cuda.device_count())
    results = run_distributed(
        _replay_worker, world, "cuda", backend="cpu:gloo,cuda:nccl", timeout=TIMEOUT
    )
    assert results == [[]] * world, results
