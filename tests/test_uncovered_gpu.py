"""On a GPU the build has no kernel image for, the MoE ops take the ATen path with a
FallbackWarning that names the architectures (never a kernel launch failure): high-throughput
dispatch and combine, and with two GPUs the low-latency dispatch and combine.

Runs only where the build does not cover the GPU: on the GPU machine, build with another
architecture, e.g. ``EP_CUDA_ARCH=100a`` on a Hopper GPU, and run this file. Elsewhere it skips,
saying so.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _dist_utils import run_distributed
from moe_helpers import cuda_routing


def _covered() -> tuple[bool, str]:
    import ep_backend._C as c

    if not c.built_with_cuda:
        return True, "the CPU build (no kernels to cover)"
    major, minor = torch.cuda.get_device_capability()
    # "90a,100a" -> {"90", "100"}; "90a-real" / "90-virtual" as CMake writes them.
    built = {a.split("-")[0].rstrip("af") for a in c.cuda_architectures.split(",") if a}
    arch = f"{major}{minor}"
    return arch in built, f"the build covers sm_{arch} ({c.cuda_architectures})"


def _aten_path_problems(seen: list[warnings.WarningMessage], transport_attr: str) -> list[str]:
    """What is wrong with an op family's fallback on an uncovered GPU: a FallbackWarning naming
    the build's architectures among the warnings `seen`, and the group's transport (the
    backend's `transport_attr`) on the ATen path."""
    import ep_backend as ep

    problems = []
    fallbacks = [str(s.message) for s in seen if issubclass(s.category, ep.FallbackWarning)]
    if not any("built for" in m for m in fallbacks):
        problems.append(f"{transport_attr}: no FallbackWarning naming the build: {fallbacks}")
    transport = getattr(ep.get_backend(), transport_attr)
    if not transport.startswith("aten"):
        problems.append(f"{transport_attr} is {transport!r}, expected the ATen path")
    return problems


def _uncovered_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep

    problems: list[str] = []
    x, idx, w = cuda_routing(96, 256, 8, 2, 50 + rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = ep.dispatch(x, idx, w, num_experts=8)
        combined = ep.combine(out.recv_x, out.handle).combined_x
    problems += _aten_path_problems(seen, "high_throughput_transport")
    # The same calls on CPU copies (the Gloo path, checked against reference.py by the CPU tests).
    want = ep.dispatch(x.cpu(), idx.cpu(), w.cpu(), num_experts=8)
    if not torch.equal(out.recv_x.cpu(), want.recv_x):
        problems.append("dispatch rows differ from the CPU path's")
    if not torch.equal(combined.cpu(), ep.combine(want.recv_x, want.handle).combined_x):
        problems.append("combine differs from the CPU path's")
    if world > 1:  # the low-latency ops (the ATen path needs NCCL: one GPU per rank)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            d = ep.low_latency_dispatch(x, idx, 128, 8, use_fp8=False)
            y = d.recv_x.clone()
            ll = ep.low_latency_combine(y, idx, w, d.handle)
        problems += _aten_path_problems(seen, "low_latency_transport")
        if ll.shape != x.shape or not torch.isfinite(ll.float()).all():
            problems.append(f"low-latency combine gave {tuple(ll.shape)} / non-finite values")
    return problems


@pytest.mark.gpu(min_gpus=1)
def test_a_gpu_the_build_does_not_cover_takes_the_aten_path_with_a_warning() -> None:
    covered, why = _covered()
    if covered:
        pytest.skip(f"{why}: build with another EP_CUDA_ARCH to run this")
    world = min(2, torch.cuda.device_count())
    for problems in run_distributed(_uncovered_worker, world, backend="ep"):
        assert problems == []
