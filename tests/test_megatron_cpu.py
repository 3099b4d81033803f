"""Megatron-Core's own ``MoELayer`` on CPU ranks: the flex dispatcher (``deepep`` backend,
through the ``deep_ep`` facade, on an ``"ep"`` group) against Megatron's ``alltoall`` dispatcher
on Gloo, same weights and inputs, on 2 and 4 ranks.

Skipped only where megatron-core is not installed (CI installs it: .ci/run). Megatron's CUDA
stream calls are stood in for by ``megatron_cpu_shim`` (its docstring lists them).
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import run_distributed
from megatron_cases import MEGATRON_SKIP_REASON, MoeShape, check_setup, megatron_installed

pytestmark = [
    pytest.mark.skipif(not megatron_installed(), reason=MEGATRON_SKIP_REASON),
    # Megatron places its parameters on CUDA whenever CUDA is available, which the CPU shim does
    # not change (the workers then mix CPU and CUDA tensors): on a CUDA machine
    # tests/test_megatron_gpu.py makes the same comparisons; CI, without GPUs, runs these.
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="the CPU comparison; on a CUDA machine tests/test_megatron_gpu.py runs instead",
    ),
]

TIMEOUT = 240.0


def _layer_worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    import megatron_cases

    megatron_cases.import_megatron()
    return megatron_cases.flex_vs_alltoall("gloo", MoeShape(), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_moe_layer_flex_on_ep_matches_alltoall_on_gloo(world: int) -> None:
    results = run_distributed(_layer_worker, world, backend="gloo", timeout=TIMEOUT)
    for rank, result in enumerate(results):
        check_setup(result["setup"], "gloo")
        flex, alltoall = result["flex"], result["alltoall"]
        assert flex.keys() == alltoall.keys()
        assert any(k.startswith("grad.") for k in flex), list(flex)
        for name in flex:
            # Bit for bit: the dispatchers move the same FP32 rows; each token's two expert
            # outputs are summed in another order (a + b == b + a with top-2), and the CPU
            # expert GEMMs give each row the same bits whatever the rows around it.
            assert torch.equal(flex[name], alltoall[name]), (
                f"rank {rank} {name}: max difference "
                f"{(flex[name] - alltoall[name]).abs().max().item():.3g}"
            )
        assert flex["output"].abs().sum() > 0 and flex["input_grad"].abs().sum() > 0


def _training_worker(rank: int, world: int, what: str, dispatcher: str, moe_backend: str) -> dict:
    torch.set_num_threads(1)
    import megatron_cases
    import megatron_training

    megatron_cases.import_megatron()
    cpu = torch.device("cpu")
    if what == "gpt":
        return megatron_training.train_gpt(dispatcher, TRAIN_STEPS, torch.float32, cpu)
    return megatron_training.train_fsdp2(dispatcher, moe_backend, TRAIN_STEPS, torch.float32, cpu)


TRAIN_STEPS = 4


@pytest.mark.parametrize("what", ["gpt", "fsdp2"])
def test_megatron_training_on_ep_matches_gloo(what: str) -> None:
    """The CPU run of the GPU training tests: the whole job on ``init_process_group("ep")`` with
    the flex dispatcher vs on Gloo with the alltoall dispatcher; the same losses, bit for bit (as
    the layer test: same rows moved, top-2 sums, row-independent CPU GEMMs)."""
    ep = run_distributed(_training_worker, 2, what, "flex", "ep", backend="ep", timeout=TIMEOUT)
    gloo = run_distributed(
        _training_worker, 2, what, "alltoall", "gloo", backend="gloo", timeout=TIMEOUT
    )
    assert ep[0]["init"] == gloo[0]["init"]
    assert ep[0]["losses"] == gloo[0]["losses"], (ep[0]["losses"], gloo[0]["losses"])
    assert ep[1]["losses"] == ep[0]["losses"]
    assert ep[0]["losses"][-1] < ep[0]["losses"][0], ep[0]["losses"]
