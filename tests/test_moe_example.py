"""``examples/moe_layer.py`` trains a MoE layer on 2 ranks and checks it against a dense layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"


def test_moe_layer_example_passes() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "PASS: 2 ranks, 6 SGD steps" in proc.stdout, output
    assert proc.stdout.count("loss") >= 6, output
