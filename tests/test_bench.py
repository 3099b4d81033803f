"""The README's main job, ``python -m ep_backend.bench``, runs end to end (tiny CPU shapes)."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ep_backend._push_limit import PushLimitProbe, compile_probe
from ep_backend.bench import sm_sweep_counts, smallest_sms_reaching


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
               "baseline all_to_all_single x2 (BF16 rows)",
               "ep loop: layout + dispatch + combine BF16", "ll dispatch FP8 + combine BF16",
               "limit: push to all peers", "bound: dispatch + combine bytes at the limit"):  # fmt: skip
        assert op in ops, (op, sorted(ops))
    # The limit and its bound need GPUs: on CPU they are rows that say so, untimed.
    not_run = {r["op"]: r["note"] for r in rows if r["note"].startswith("not run")}
    assert set(not_run) == {"limit: push to all peers",
                            "bound: dispatch + combine bytes at the limit"}, not_run  # fmt: skip
    assert all("needs GPUs" in note for note in not_run.values()), not_run
    assert all(r["us"] > 0 for r in rows if r["op"] not in not_run), rows
    loop = next(r for r in rows if r["op"] == "ll dispatch FP8 + combine BF16")
    assert "loop of 10 steps" in loop["note"], loop
    swept = sorted(r["tokens"] for r in rows if r["op"] == "ep dispatch+combine BF16")
    assert swept == [32, 128, 256], swept
    assert "== low latency" in done.stdout and "ep is" in done.stdout
    assert "ep build: " in done.stdout  # what the build made, since pip hides its output
    # How late ranks left the bench's host barriers (what "call" and "host" can hold).
    late = re.search(r"host barriers: the latest rank left (\d+) barriers a median ([\d.]+) µs "
                     r"\(max ([\d.]+)\)", done.stdout)  # fmt: skip
    assert late is not None, done.stdout
    assert int(late.group(1)) > 0 and 0 <= float(late.group(2)) <= float(late.group(3)), late


def test_sm_sweep_says_it_needs_gpus_on_cpu(tmp_path) -> None:
    cmd = [sys.executable, "-m", "ep_backend.bench", "--cpu", "--tokens", "16", "--hidden", "128",
           "--experts", "8", "--iters", "1", "--warmup", "0", "--no-sweep", "--no-low-latency",
           "--sm-sweep", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--sm-sweep: needs GPUs" in done.stdout, done.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())
    sweep = [r for r in rows if r["op"].startswith("sm sweep")]
    assert [(r["op"], r["us"]) for r in sweep] == [("sm sweep", 0.0)], sweep
    assert sweep[0]["note"] == "not run: needs GPUs (one per rank)", sweep


def test_negative_num_sms_is_refused() -> None:
    cmd = [sys.executable, "-m", "ep_backend.bench", "--cpu", "--num-sms", "-1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--num-sms -1" in done.stderr, done.stderr


def test_sm_sweep_counts_are_capped_at_the_device() -> None:
    assert sm_sweep_counts(132) == [4, 8, 12, 16, 20, 24, 32, 48, 64, 96, 132]
    assert sm_sweep_counts(78) == [4, 8, 12, 16, 20, 24, 32, 48, 64, 78]
    assert sm_sweep_counts(4) == [4]
    with pytest.raises(ValueError, match="sm_count 0"):
        sm_sweep_counts(0)


def test_smallest_sms_reaching_95_percent_of_the_best() -> None:
    def row(n: int, us: float, op: str = "sm sweep: combine BF16") -> dict:
        return {"op": op, "num_sms": n, "us": us}

    # combine slower above 24 SMs (as issue 43 measured): the best is at 24, 16 is 96.3% of it
    rows = [row(8, 461.0), row(12, 329.0), row(16, 207.6), row(24, 200.0), row(32, 227.0),
            row(16, 1.0, "sm sweep: dispatch BF16")]  # fmt: skip
    assert smallest_sms_reaching(rows, "sm sweep: combine BF16") == (16, 24, 200.0)
    assert smallest_sms_reaching(rows, "sm sweep: combine BF16", 0.97) == (24, 24, 200.0)
    assert smallest_sms_reaching(rows, "sm sweep: push limit") is None
    # untimed rows (0 µs) are not candidates
    assert smallest_sms_reaching([row(4, 0.0), row(8, 10.0)], "sm sweep: combine BF16") == (
        8, 8, 10.0)  # fmt: skip
    with pytest.raises(ValueError, match="fraction"):
        smallest_sms_reaching(rows, "sm sweep: combine BF16", 1.5)


def test_push_limit_probe_validates_its_shape() -> None:
    with pytest.raises(ValueError, match="1 ranks"):
        PushLimitProbe(Path("unused.so"), None, "k", 0, 1, torch.device("cpu"), 16, 1 << 20)
    with pytest.raises(ValueError, match="9 ranks"):
        PushLimitProbe(Path("unused.so"), None, "k", 0, 9, torch.device("cpu"), 16, 1 << 20)
    with pytest.raises(ValueError, match="row_bytes 24"):
        PushLimitProbe(Path("unused.so"), None, "k", 0, 2, torch.device("cpu"), 24, 1 << 20)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile only, no GPU)")
def test_push_limit_probe_compiles_and_rejects_bad_launches(tmp_path) -> None:
    lib_path, why = compile_probe(tmp_path, "sm_90a")
    assert lib_path is not None, why
    assert compile_probe(tmp_path, "sm_90a") == (lib_path, "")  # cached: same file, no rebuild
    lib = ctypes.CDLL(str(lib_path))
    lib.ep_probe_error.restype = ctypes.c_char_p
    assert lib.ep_probe_handle_bytes() == 64  # cudaIpcMemHandle_t: what the store carries
    peers = (ctypes.c_void_p * 1)(None)
    # argument checks run before any CUDA call: no driver needed
    for num_peers, row_bytes, num_sms in ((0, 16, 1), (8, 16, 1), (1, 24, 1), (1, 16, 0)):
        code = lib.ep_probe_push(None, peers, num_peers, 1, row_bytes, num_sms, None)
        assert code == 1, (num_peers, row_bytes, num_sms, code)  # cudaErrorInvalidValue
    assert lib.ep_probe_error(1) == b"invalid argument"


def test_push_limit_rows_go_round_robin_over_the_senders_peers() -> None:
    # rank 1 of 3 sends 4 rows per peer: rows 0, 2, 4, 6 to rank 0, rows 1, 3, 5, 7 to rank 2
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (8 * 16,), dtype=torch.uint8, generator=gen).view(8, 16)
    assert torch.equal(PushLimitProbe.rows_sent(1, 0, 3, 4, 16), src[0::2])
    assert torch.equal(PushLimitProbe.rows_sent(1, 2, 3, 4, 16), src[1::2])
