"""The bench's GPU-only parts: the push-limit probe lands every row where it says, and the bench's
limit, "% limit", loop and SM-sweep rows come out on GPUs (one rank per GPU, 2..8)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

from ep_backend._push_limit import PushLimitProbe, compile_probe, device_arch

ROW_BYTES = 14336  # one BF16 row at H = 7168


def _probe_worker(rank: int, world: int, lib: str) -> tuple[int, float]:
    device = torch.device("cuda", torch.cuda.current_device())
    store = dist.distributed_c10d._get_default_store()
    probe = PushLimitProbe(Path(lib), store, "test/push_limit", rank, world, device, ROW_BYTES,
                           4 << 20)  # fmt: skip
    assert not probe.setup_error, probe.setup_error
    try:
        probe.launch(24)
        torch.cuda.synchronize()
        dist.barrier()
        wrong = 0
        for peer in range(world):
            if peer == rank:
                continue
            expected = PushLimitProbe.rows_sent(peer, rank, world, probe.rows_per_peer, ROW_BYTES)
            wrong += int((probe.received(peer) != expected).any(dim=1).sum())
        # a rough rate, to see the launch moves data at all (the bench times it properly)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            probe.launch(24)
        end.record()
        end.synchronize()
        gbps = 5 * probe.bytes_per_launch / (start.elapsed_time(end) * 1e6)
    finally:
        probe.close()
        dist.barrier()
        probe.free()
    return wrong, gbps


@pytest.mark.gpu(min_gpus=2)
def test_push_limit_probe_lands_every_row_in_its_peer_slot() -> None:
    world = min(torch.cuda.device_count(), 8)  # one rank per GPU: the pushes cross NVLink
    lib, why = compile_probe(Path(tempfile.mkdtemp()), device_arch(torch.device("cuda", 0)))
    assert lib is not None, why
    results = run_distributed(_probe_worker, world, str(lib), backend="gloo")
    assert [wrong for wrong, _ in results] == [0] * world, results
    assert all(gbps > 1.0 for _, gbps in results), results


@pytest.mark.gpu(min_gpus=2)
def test_bench_prints_the_limit_loop_and_sm_sweep_rows(tmp_path) -> None:
    cmd = [sys.executable, "-m", "ep_backend.bench", "--tokens", "1024", "--iters", "3",
           "--no-sweep", "--no-low-latency", "--sm-sweep", "--a2a-iters", "3",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {(r["op"], r["num_sms"]): r for r in json.loads((tmp_path / "bench.json").read_text())}
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    budget = rows[("limit: push to all peers, 24 SMs (Options.num_sms)", 24)]
    full = rows[(f"limit: push to all peers, all {sm_count} SMs", sm_count)]
    assert budget["us"] > 0 and budget["remote_gbps"] > 0 and budget["limit_pct"] == 100.0
    assert full["remote_gbps"] > 0
    dispatch = rows[("ep dispatch BF16", 0)]
    assert 0 < dispatch["limit_pct"] < 150, dispatch  # a ratio of two rates of the same link
    assert abs(dispatch["limit_pct"] - 100 * dispatch["remote_gbps"] / budget["remote_gbps"]) < 0.1
    bound = rows[("bound: dispatch + combine bytes at the limit", 0)]
    loop = rows[("ep loop: layout + dispatch + combine BF16", 0)]
    assert bound["us"] > 0 and loop["us"] > 0 and "x the bound" in loop["note"], (bound, loop)
    for n in (4, 8, 16, 24, sm_count):
        for op in ("sm sweep: dispatch BF16", "sm sweep: combine BF16", "sm sweep: push limit"):
            assert rows[(op, n)]["us"] > 0, (op, n)
    assert "dispatch BF16: " in done.stdout and "SMs reach 95% of its best" in done.stdout
    # the all-to-all section: at 2 ranks and at every GPU, every size timed on ep's kernels
    a2a = json.loads((tmp_path / "bench_all_to_all.json").read_text())
    gpus = torch.cuda.device_count()
    assert sorted(a2a) == sorted({"2", str(gpus)}), list(a2a)
    for world, table in a2a.items():
        assert table["transport"] == "nvlink", (world, table["transport"])
        sizes = [k for k in table if k != "transport"]
        assert len(sizes) == 6 and all(table[k]["ep host splits"] > 0 for k in sizes), table
    assert done.stdout.count("targets (issue 42)") == len(a2a), done.stdout


@pytest.mark.gpu(min_gpus=2)
def test_bench_reads_the_low_latency_rows_against_the_link(tmp_path) -> None:
    """LL section alone: it measures the all-SM push limit itself, prints a bound per op, and
    every LL row's remote GB/s and "% limit" are its wire bytes over its time and that limit."""
    cmd = [sys.executable, "-m", "ep_backend.bench", "--iters", "3", "--no-high-throughput",
           "--no-sweep", "--no-all-to-all", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["op"]: r for r in json.loads((tmp_path / "bench.json").read_text())}
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    limit = rows[f"ll limit: push to all peers, all {sm_count} SMs"]
    assert limit["us"] > 0 and limit["remote_gbps"] > 0, limit
    bounds = {}
    for name in ("dispatch FP8", "dispatch BF16", "combine BF16", "dispatch FP8 + combine BF16"):
        bound = rows[f"ll bound: {name} wire bytes at the limit (all SMs)"]
        assert bound["us"] > 0 and " MB (" in bound["note"] and "rank " in bound["note"], bound
        bounds[name] = bound["us"]
    # BF16 messages are larger than FP8 ones; the pair's bytes are the two ops' together
    assert bounds["dispatch BF16"] > bounds["dispatch FP8"]
    pair = bounds["dispatch FP8"] + bounds["combine BF16"]
    assert abs(bounds["dispatch FP8 + combine BF16"] - pair) < 1e-6 * pair
    for op, name in (("ll dispatch FP8", "dispatch FP8"), ("ll combine BF16", "combine BF16"),
                     ("ll dispatch FP8 (graph)", "dispatch FP8")):  # fmt: skip
        row = rows[op]
        assert row["us"] > 0, row
        # wire bytes / time, against the same limit: the bound's time over the row's time
        expected_pct = 100 * bounds[name] / row["us"]
        assert abs(row["limit_pct"] - expected_pct) < 0.01 * expected_pct, (row, expected_pct)
        assert 0 < row["limit_pct"] <= 100, row  # no op beats the link
