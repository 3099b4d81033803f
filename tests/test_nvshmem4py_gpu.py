"""nvshmem4py in the same process as ep's own NVSHMEM runtime (2+ GPUs).

Runs ``tests/nvshmem4py_trial.py`` in both orders: nvshmem4py bootstraps NVSHMEM by a unique id
through the c10d store, allocates a symmetric torch tensor and writes into the peer's copy, and
ep's low-latency dispatch + combine run correctly before and after it. Skipped where the
optional ``nvshmem4py-cu13`` package is not installed (``tools/gpu_check.sh`` installs it from
``.whl312/`` when those wheels are present).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None, reason="nvshmem4py not installed")
@pytest.mark.parametrize("order", ["n4p-first", "ep-first"])
def test_nvshmem4py_beside_ep(order: str) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "nvshmem4py_trial.py"), "--order", order],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    summary = [line for line in run.stdout.splitlines() if line.startswith("TRIAL ")]
    assert summary and summary[-1].endswith(" 0 failed"), out[-4000:]
    assert "passed" in summary[-1] and not summary[-1].startswith(f"TRIAL {order}: 0 passed")
