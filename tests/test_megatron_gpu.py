"""Megatron-Core on GPUs, one rank per GPU (2 or 4: the GPU count), switched between backends:

* its ``MoELayer``: flex dispatcher (``deepep`` backend through the facade) on an ``"ep"`` group
  vs the ``alltoall`` dispatcher on NCCL, same weights and inputs (FP32);
* its ``alltoall`` dispatcher on an ``"ep"`` group vs on NCCL: the same bits (BF16);
* a tiny MoE ``GPTModel`` trained 20 steps with the whole job on ``init_process_group("ep")``
  and the flex dispatcher vs the whole job on NCCL with the alltoall dispatcher (BF16);
* a small model around the ``MoELayer`` under FSDP2 (``fully_shard``) on an ``"ep"`` world
  vs on a NCCL world (BF16).

Skipped where megatron-core is not installed (tools/megatron_gpu_check.sh installs the carried
wheels on the GPU machine).
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import gpu_world_size, run_distributed
from megatron_cases import MEGATRON_SKIP_REASON, MoeShape, check_setup, megatron_installed

pytestmark = [
    pytest.mark.skipif(not megatron_installed(), reason=MEGATRON_SKIP_REASON),
    pytest.mark.gpu(min_gpus=2),
]

TIMEOUT = 300.0
STEPS = 20


def _world() -> int:
    return min(gpu_world_size(), torch.cuda.device_count())


def _layer_worker(rank: int, world: int) -> dict:
    import megatron_cases

    megatron_cases.import_megatron()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    return megatron_cases.flex_vs_alltoall("nccl", MoeShape(), torch.float32, device)


def test_megatron_moe_layer_flex_on_ep_matches_alltoall_on_nccl() -> None:
    world = _world()
    results = run_distributed(_layer_worker, world, backend="cpu:gloo,cuda:nccl", timeout=TIMEOUT)
    for rank, result in enumerate(results):
        check_setup(result["setup"], "nccl")
        flex, alltoall = result["flex"], result["alltoall"]
        assert flex.keys() == alltoall.keys()
        for name in flex:
            # FP32 without TF32; the dispatchers differ only in the order of the top-k sum and in
            # the row count of each expert GEMM call (cuBLAS may pick another kernel).
            torch.testing.assert_close(flex[name], alltoall[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")  # fmt: skip
        assert flex["output"].abs().sum() > 0


def _alltoall_worker(rank: int, world: int) -> dict:
    import megatron_cases

    megatron_cases.import_megatron()
    # Bitwise only if each run is deterministic: the permutation's backward (index_select's
    # gradient) and unpermute (scatter_add_) accumulate with atomics in their default CUDA
    # kernels, in an order that can differ between the two layers' runs.
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", torch.cuda.current_device())
    return megatron_cases.alltoall_on_ep_vs_reference("nccl", MoeShape(), torch.bfloat16, device)


def test_megatron_alltoall_dispatcher_on_ep_is_bitwise_nccl() -> None:
    """Megatron's own ``alltoall`` dispatcher, unchanged, on an ``"ep"`` group: its
    ``all_to_all_single`` calls take ep's NVLink kernel, and the layer's outputs and gradients have
    the bits of the same layer on NCCL (the exchanges are copies; everything else is the same
    code on the same device)."""
    world = _world()
    results = run_distributed(
        _alltoall_worker, world, backend="cpu:gloo,cuda:nccl", timeout=TIMEOUT
    )
    for rank, result in enumerate(results):
        setup = result["setup"]
        assert setup["ep_backend"] == "ep" and setup["reference_backend"] == "nccl", setup
        assert setup["all_to_all_transport"] == "nvlink", setup
        on_ep, reference = result["ep"], result["reference"]
        assert on_ep.keys() == reference.keys()
        for name in on_ep:
            assert torch.equal(on_ep[name], reference[name]), (rank, name)
        assert on_ep["output"].abs().sum() > 0


def _gpt_worker(rank: int, world: int, dispatcher: str) -> dict:
    import megatron_cases
    import megatron_training

    megatron_cases.import_megatron()
    device = torch.device("cuda", torch.cuda.current_device())
    return megatron_training.train_gpt(dispatcher, STEPS, torch.bfloat16, device)


def _fsdp2_worker(rank: int, world: int, dispatcher: str, moe_backend: str) -> dict:
    import megatron_cases
    import megatron_training

    megatron_cases.import_megatron()
    device = torch.device("cuda", torch.cuda.current_device())
    return megatron_training.train_fsdp2(dispatcher, moe_backend, STEPS, torch.bfloat16, device)


def assert_same_training(ep: list[dict], reference: list[dict], rtol: float) -> None:
    """The two jobs started from the same weights, trained, and logged the same losses within
    ``rtol`` at every step (BF16 round-off: the flex path sums the top-k expert outputs in FP32
    inside ``ep``'s combine and rounds once; the alltoall path scatter-adds them in BF16)."""
    assert ep[0]["init"] == reference[0]["init"]
    ep_losses, ref_losses = ep[0]["losses"], reference[0]["losses"]
    assert len(ep_losses) == len(ref_losses) == STEPS
    for run in (ep, reference):  # every rank logged the same data-parallel mean
        assert all(r["losses"] == run[0]["losses"] for r in run), run
    worst = max(abs(a - b) / abs(b) for a, b in zip(ep_losses, ref_losses, strict=True))
    assert worst <= rtol, f"max relative loss difference {worst:.3g}: {ep_losses} vs {ref_losses}"
    assert ep_losses[-1] < ep_losses[0], f"the loss did not go down: {ep_losses}"


def test_megatron_gpt_trains_the_same_on_ep_and_nccl() -> None:
    world = _world()
    ep = run_distributed(_gpt_worker, world, "flex", backend="ep", timeout=TIMEOUT)
    nccl = run_distributed(_gpt_worker, world, "alltoall", backend="nccl", timeout=TIMEOUT)
    assert_same_training(ep, nccl, rtol=2e-2)


def test_fsdp2_moe_trains_the_same_on_ep_and_nccl() -> None:
    world = _world()
    ep = run_distributed(_fsdp2_worker, world, "flex", "ep", backend="ep", timeout=TIMEOUT)
    nccl = run_distributed(
        _fsdp2_worker, world, "alltoall", "nccl", backend="nccl", timeout=TIMEOUT
    )
    assert_same_training(ep, nccl, rtol=2e-2)
