"""The README's main job, ``python -m ep_backend.bench``, runs end to end (tiny CPU shapes)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_on_cpu_and_reports_every_op(tmp_path) -> None:
    cmd = [sys.executable, "-m", "ep_backend.bench", "--cpu", "--tokens", "32", "--hidden", "256",
           "--experts", "8", "--iters", "2", "--warmup", "1", "--sweep", "--sweep-max", "256",
           "--ll-tokens", "16", "--ll-max-tokens", "32", "--ll-experts", "8",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "bench.json").read_text())
    ops = {r["op"] for r in rows}
    for op in ("ep layout", "ep dispatch BF16", "ep dispatch FP8", "ep cached dispatch BF16",
               "ep dispatch BF16, own layout", "ep dispatch FP8, own layout",
               "ep dispatch BF16, slabs all held", "ep dispatch BF16, worst-case",
               "ep combine BF16", "ep dispatch+combine BF16", "baseline a2a pipeline (both ways)",
               "ll dispatch FP8", "ll dispatch BF16", "ll combine BF16",
               "ll dispatch FP8, hook mode: send+recv", "ll dispatch FP8, hook mode: send",
               "ll dispatch FP8, hook mode: recv (hook)",
               "baseline all_to_all_single x2 (BF16 rows)"):  # fmt: skip
        assert op in ops, (op, sorted(ops))
    assert all(r["us"] > 0 for r in rows), rows
    swept = sorted(r["tokens"] for r in rows if r["op"] == "ep dispatch+combine BF16")
    assert swept == [32, 128, 256], swept
    assert "== low latency" in done.stdout and "ep is" in done.stdout
    assert "ep build: " in done.stdout  # what the build made, since pip hides its output
