"""Shared pytest setup: the ``gpu`` marker skips without enough CUDA devices."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Keep NVLink multicast off everywhere (GPU machine policy); harmless elsewhere.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = num_gpus()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.kwargs.get("min_gpus", 1))
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {gpus}"))


@pytest.fixture(autouse=True)
def _one_gpu_test_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """GPU tests hold an inter-process lock: each one uses every GPU, so pytest-xdist workers
    (``-n 2``) must not run two at once; CPU tests run beside them."""
    if request.node.get_closest_marker("gpu") is None or num_gpus() == 0:
        yield
        return
    lock_path = Path(tempfile.gettempdir()) / f"ep_backend_gpu_tests_{os.getuid()}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
