"""The malformed-call suite on CUDA tensors: the CUDA subset of ``test_moe_validation`` and
``test_malformed_calls``, one rank per GPU (``gpu_world_size()``, at least 2).

Each case runs as on CPU (``case_worker`` with ``device_type="cuda"``: the context's tensors
and those the cases make are on the rank's GPU), through the NVLink and NVSHMEM transports, and
is held to the same contract: every rank raises the documented type with the documented message
within ``CASE_SECONDS`` (a case that raises nothing is followed by a device sync, so an error the
kernels found is raised there and counts too), and the next valid dispatch + combine on the GPU
equals ``ep_backend.reference`` (on CPU) bit for bit. Left out: the two ``previous_event`` cases
that pass an event while the tensors are on CPU, which only a CPU call can make, and the cases
the kernels find (``FOUND_BY_THE_KERNELS``), which the group's next call raises.
"""

from __future__ import annotations

from typing import Any

import pytest
import test_malformed_calls as malformed
import test_moe_validation as validation
from _dist_utils import gpu_world_size, run_distributed

CPU_ONLY = ("previous_event_on_cpu", "combine_previous_event_on_cpu")
# Found by the kernels on CUDA (the host never reads topk_idx, and a num_worst_tokens dispatch has
# no host step): raised by the group's next call, as docs/api.md says, so not by the call itself;
# test_moe_gpu and test_intranode_gpu check that contract for them.
FOUND_BY_THE_KERNELS = (
    "num_worst_tokens_too_small", "ll_expert_repeated_beyond_max", "ll_expert_id_too_large",
    "ll_combine_expert_id_too_large",
)  # fmt: skip
# Not an error on the NVSHMEM path (docs/api.md): its low-latency combine takes the routes its
# dispatch kept with the handle and reads only topk_idx's shape, so another topk_idx of that
# shape combines as the dispatch routed (checking the values would be a device compare in the
# latency-bound call).
TRUSTED_ON_CUDA = ("ll_combine_other_routing",)
VALIDATION_NAMES = [
    name for name in validation.CASES
    if name not in CPU_ONLY + FOUND_BY_THE_KERNELS + TRUSTED_ON_CUDA
]  # fmt: skip
MALFORMED_NAMES = list(malformed.CASES)
TIMEOUT = 240.0  # one run per module; its first low-latency call sets up NVSHMEM

_RESULTS: dict[str, list[dict[str, Any]]] = {}


def _results(module: str, names: list[str]) -> list[dict[str, Any]]:
    """Every rank's outcomes of ``names`` (one CUDA run per module, cached per process)."""
    if module not in _RESULTS:
        _RESULTS[module] = run_distributed(
            validation.case_worker, gpu_world_size(), module, names, "cuda", backend="ep",
            timeout=TIMEOUT,
        )  # fmt: skip
    return _RESULTS[module]


def test_the_cuda_subset_has_at_least_sixty_cases() -> None:
    assert len(VALIDATION_NAMES) + len(MALFORMED_NAMES) >= 60


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("name", VALIDATION_NAMES)
def test_every_rank_raises_on_cuda(name: str) -> None:
    per_rank = _results("test_moe_validation", VALIDATION_NAMES)
    validation.check_every_rank_raised(validation.CASES[name], [r[name] for r in per_rank])


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("name", MALFORMED_NAMES)
def test_every_rank_raises_the_documented_type_on_cuda(name: str) -> None:
    per_rank = _results("test_malformed_calls", MALFORMED_NAMES)
    malformed.check_documented_type(malformed.CASES[name], [r[name] for r in per_rank])
