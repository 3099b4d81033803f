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

from ep_backend import _bench_all_to_all as a2a
from ep_backend._ll_wire import (
    LinkLoad,
    LLWire,
    header_bytes,
    ll_link_bytes,
    ll_wire_bytes,
    message_bytes,
)
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
    for op in ("ll dispatch FP8 + combine BF16", "ll dispatch FP8 + combine BF16, BF16 partials"):
        loop = next(r for r in rows if r["op"] == op)
        assert "loop of 10 steps" in loop["note"], loop
    assert "low_latency_combine_bf16_partials" in loop["note"], loop
    swept = sorted(r["tokens"] for r in rows if r["op"] == "ep dispatch+combine BF16")
    assert swept == [32, 128, 256], swept
    assert "== low latency" in done.stdout and "ep is" in done.stdout
    assert "ep build: " in done.stdout  # what the build made, since pip hides its output
    # How late ranks left the bench's host barriers (what "call" and "host" can hold).
    late = re.search(r"host barriers: the latest rank left (\d+) barriers a median ([\d.]+) µs "
                     r"\(max ([\d.]+)\)", done.stdout)  # fmt: skip
    assert late is not None, done.stdout
    assert int(late.group(1)) > 0 and 0 <= float(late.group(2)) <= float(late.group(3)), late
    # How the MoE calls agreed (part of "call" and "host"): two ranks of one host share memory.
    assert "MoE agreement: shared memory" in done.stdout, done.stdout


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


def _a2a_results(ep: list[float], nccl: list[float], limit: list[float | str]) -> dict:
    """A hand-made result of the all-to-all section (µs per size; 4 ranks' figures of the docs)."""
    results: dict = {"transport": "nvlink"}
    for size, e, n, lim in zip(a2a.SIZES, ep, nccl, limit, strict=True):
        results[size] = {a2a.EP_HOST: e, a2a.EP_HOST + a2a.HOST: 12.0, "ep device splits": e + 1,
                         "ep device splits" + a2a.HOST: 20.0, a2a.NCCL: n,
                         a2a.NCCL + a2a.HOST: 9.5, "symm_mem all_to_all_vdev": "n/a: RuntimeError",
                         a2a.LIMIT: lim}  # fmt: skip
    return results


_EP = [38.9, 26.9, 30.1, 147.0, 1089.8, 4072.0]
_NCCL = [157.4, 81.8, 79.8, 127.2, 716.2, 2462.6]
_LIMIT: list[float | str] = [17.7, 16.7, 17.2, 76.0, 590.0, 2360.0]


def test_all_to_all_ratios_and_targets() -> None:
    results = _a2a_results(_EP, _NCCL, _LIMIT)
    r = a2a.ratios(results)
    x, pct = r[4 << 10]
    assert x == pytest.approx(157.4 / 38.9) and pct == pytest.approx(100 * 17.7 / 38.9)
    assert a2a.target_summary(results) == (
        "targets (issue 42): >= NCCL at every size: no (worst 256 MiB: 0.60x); "
        ">= 2x NCCL at <= 1 MiB: yes (worst 1 MiB: 2.65x); "
        ">= 90% of the push limit at >= 64 MiB: no (worst 64 MiB: 54.1%)"
    )
    # every target met: ep at NCCL's half time and at the limit's time
    met = _a2a_results(_EP, [2 * e for e in _EP], list(_EP))
    summary = a2a.target_summary(met)
    assert summary.count(": yes (worst") == 3 and ": no" not in summary, summary
    # no push limit (no nvcc): its target is n/a, the NCCL ones still read
    no_limit = _a2a_results(_EP, _NCCL, ["n/a: nvcc"] * len(a2a.SIZES))
    assert a2a.ratios(no_limit)[1 << 20] == (pytest.approx(79.8 / 30.1), None)
    assert a2a.target_summary(no_limit).endswith(
        ">= 90% of the push limit at >= 64 MiB: n/a (the push limit not measured at every size)"
    )


def test_all_to_all_table_lines() -> None:
    lines = a2a.format_table(_a2a_results(_EP, _NCCL, _LIMIT), 4)
    assert lines[0] == "all-to-all, 4 ranks, ep transport: nvlink"
    assert "NCCL all_to_all_single (host µs/call)" in lines[1]
    assert lines[1].split()[-4:] == ["x", "NCCL", "%", "limit"]
    rows = [line for line in lines if " KiB " in line and "targets" not in line]
    assert [int(line.split()[0]) for line in rows] == [s >> 10 for s in a2a.SIZES]
    # 4 KiB: ep 38.9 µs, 3 x 4 KiB sent -> 0.3 GB/s; NCCL 157.4 µs; NCCL's host time
    assert "38.9 us     0.3 GB/s" in rows[0] and "157.4 us" in rows[0] and "9.5 us host" in rows[0]
    assert rows[0].endswith("4.05x   45.5%"), rows[0]
    assert rows[-1].endswith("0.60x   58.0%"), rows[-1]
    assert "  symm_mem all_to_all_vdev: n/a: RuntimeError" in lines
    assert lines[-1].startswith("targets (issue 42): ")
    # the header lines up with the rows
    assert len(lines[1]) == len(rows[0]), (lines[1], rows[0])


def test_all_to_all_rank_counts_and_sizes() -> None:
    assert a2a.rank_counts(0) == [] and a2a.rank_counts(1) == []
    assert a2a.rank_counts(2) == [2] and a2a.rank_counts(4) == [2, 4]
    assert a2a.rank_counts(8) == [2, 8]
    assert [a2a.size_label(s) for s in a2a.SIZES] == ["4 KiB", "64 KiB", "1 MiB", "8 MiB",
                                                      "64 MiB", "256 MiB"]  # fmt: skip


def test_all_to_all_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    results = _a2a_results(_EP, _NCCL, _LIMIT)
    png = tmp_path / "bench_all_to_all.png"
    assert a2a.plot({2: results, 4: results}, png)
    assert png.stat().st_size > 0


def test_bench_help_lists_the_all_to_all_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "ep_backend.bench", "--help"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--no-all-to-all" in done.stdout and "--a2a-iters" in done.stdout, done.stdout
    refused = subprocess.run([sys.executable, "-m", "ep_backend.bench", "--cpu", "--a2a-iters", "0"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "--a2a-iters 0" in refused.stderr, refused.stderr


def test_bench_on_cpu_says_why_the_all_to_all_section_is_skipped(tmp_path) -> None:
    cmd = [sys.executable, "-m", "ep_backend.bench", "--cpu", "--tokens", "16", "--hidden", "128",
           "--experts", "8", "--iters", "1", "--warmup", "0", "--no-sweep", "--no-low-latency",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all-to-all section skipped: needs at least 2 GPUs (running on CPU)" in done.stdout
    assert not (tmp_path / "bench_all_to_all.png").exists()
    done = subprocess.run(cmd + ["--no-all-to-all"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all-to-all" not in done.stdout, done.stdout


def test_bench_all_to_all_section_prints_and_writes_each_rank_count(tmp_path, monkeypatch,
                                                                    capsys) -> None:  # fmt: skip
    from ep_backend import bench

    ran = []

    def fake_run(world: int, iters: int, port: int, probe_lib: str) -> dict:
        ran.append((world, iters, probe_lib))
        return _a2a_results(_EP, _NCCL, _LIMIT)

    monkeypatch.setattr(a2a, "run", fake_run)
    assert bench._all_to_all_section(4, 7, tmp_path, "probe.so") == 0
    assert ran == [(2, 7, "probe.so"), (4, 7, "probe.so")]
    out = capsys.readouterr().out
    assert "== all-to-all at 2 and 4 ranks" in out
    assert "all-to-all, 2 ranks, ep transport: nvlink" in out
    assert "all-to-all, 4 ranks, ep transport: nvlink" in out
    assert out.count("targets (issue 42): ") == 2
    data = json.loads((tmp_path / "bench_all_to_all.json").read_text())
    assert sorted(data) == ["2", "4"] and data["4"]["4096"][a2a.NCCL] == 157.4

    # one rank count failing leaves the others' tables, and the bench says so (exit status 1)
    def failing_run(world: int, iters: int, port: int, probe_lib: str) -> dict:
        if world == 4:
            raise RuntimeError("worker died")
        return _a2a_results(_EP, _NCCL, _LIMIT)

    monkeypatch.setattr(a2a, "run", failing_run)
    assert bench._all_to_all_section(4, 7, tmp_path, "") == 1
    out = capsys.readouterr().out
    assert "all-to-all at 4 ranks failed: RuntimeError: worker died" in out
    assert out.count("targets (issue 42): ") == 1
    assert bench._all_to_all_section(1, 7, tmp_path, "") == 0
    assert "all-to-all section skipped: needs at least 2 GPUs (1 GPU)" in capsys.readouterr().out


def _open_probe_that_cannot_load(rank: int, world: int, missing: str) -> tuple[bool, str]:
    import torch.distributed as dist

    from ep_backend._push_limit import close_on_every_rank, open_on_every_rank

    store = dist.distributed_c10d._get_default_store()
    probe, why = open_on_every_rank(Path(missing), store, "test/push_limit", rank, world,
                                    torch.device("cpu"), 4096, 1 << 20, torch.device("cpu"))  # fmt: skip
    close_on_every_rank(probe)  # collective also without a probe: must not hang
    return probe is None, why


def test_push_limit_probe_that_fails_is_given_up_by_every_rank(tmp_path) -> None:
    """The probe's collective open: a rank whose probe cannot be set up (here: no library) makes
    every rank go without it, each saying why, and the collective close still pairs up."""
    from _dist_utils import run_distributed

    missing = str(tmp_path / "no_such_probe.so")
    results = run_distributed(_open_probe_that_cannot_load, 2, missing, timeout=60)
    for rank, (none, why) in enumerate(results):
        assert none, rank
        assert why.startswith(f"probe failed on rank {rank}: ") and "no_such_probe" in why, why


def test_ll_message_sizes_are_the_kernels() -> None:
    # nvshmem_common.hpp: header = 8 + 8 per entry slot of the largest top-k, rounded up to 16;
    # payload BF16 2H, or FP8 H + H/128 float32 scales, rounded up to 16
    assert header_bytes(8) == 80 and header_bytes(1) == 16 and header_bytes(32) == 272
    assert message_bytes(7168, fp8=False, max_topk=8) == 80 + 14336
    assert message_bytes(7168, fp8=True, max_topk=8) == 80 + 7168 + 56 * 4
    assert message_bytes(128, fp8=True, max_topk=4) == 48 + 144  # 128 + 4 rounded up to 144


def test_ll_wire_bytes_by_hand() -> None:
    # 4 ranks, 16 experts (rank d holds 4d .. 4d + 3), H = 128, top-4, rank 0's four tokens
    idx = torch.tensor([[4, 5, 6, 7],  # all four on rank 1: one message, one float32 partial
                        [0, 8, 9, 12],  # local; 2 on rank 2 (float32); 1 on rank 3 (BF16 row)
                        [1, -1, -1, -1],  # local only: nothing leaves
                        [-1, -1, -1, -1]])  # fmt: skip
    wire = ll_wire_bytes(idx, 16, 4, 0, 128)
    fp8_msg, bf16_msg = 48 + 128 + 16, 48 + 256  # header 8 + 4 x 8 -> 48; FP8 scales 1 x 4 -> 16
    signals = 8 * (1 + 4 + 4)  # to every peer: token count, 4 row counts, a flag per token
    assert wire.dispatch_fp8 == (0, fp8_msg + signals, fp8_msg + signals, fp8_msg + signals)
    assert wire.dispatch_bf16 == (0, bf16_msg + signals, bf16_msg + signals, bf16_msg + signals)
    assert wire.dispatch_fp8_sent == 3 * (192 + 72) and wire.dispatch_bf16_sent == 3 * (304 + 72)
    weights = 4 * 4 * 8 + 8  # T x K tagged u64 words to every peer, then the weights flag
    assert wire.combine_weights == (0, weights, weights, weights)
    float32, bf16 = 4 * 128 + 8, 2 * 128 + 8  # a partial and its flag
    assert wire.combine_partials == (0, float32, float32, bf16)
    assert wire.combine_partials_received == 2 * 520 + 264
    assert LLWire.from_tensor(0, wire.as_tensor()) == wire
    # all k on one remote rank: one message and one partial, not k; a larger runtime top-k
    # widens the header only
    one = ll_wire_bytes(torch.tensor([[12, 13, 14, 15]]), 16, 4, 1, 128, max_topk=8)
    assert one.dispatch_bf16 == (8 * 6, 0, 8 * 6, 80 + 256 + 8 * 6)  # T = 1: 6 signals a peer
    assert one.combine_partials == (0, 0, 0, 4 * 128 + 8)
    # BF16 partials: a sum goes back in a BF16 row's bytes; nothing else changes
    halved = ll_wire_bytes(idx, 16, 4, 0, 128, bf16_partials=True)
    assert halved.combine_partials == (0, bf16, bf16, bf16)
    assert halved.dispatch_fp8 == wire.dispatch_fp8
    assert halved.combine_weights == wire.combine_weights


def test_ll_link_bytes_puts_every_ranks_share_together() -> None:
    # 2 ranks, 4 experts (rank 1 holds 2 and 3), H = 128, top-2
    wires = [ll_wire_bytes(torch.tensor([[2, 3], [0, 2], [0, 1]]), 4, 2, 0, 128),
             ll_wire_bytes(torch.tensor([[0, -1]]), 4, 2, 1, 128)]  # fmt: skip
    msg = 32 + 128 + 16  # FP8: header 8 + 2 x 8 -> 32
    to_1, to_0 = 2 * msg + 8 * (1 + 2 + 3), msg + 8 * (1 + 2 + 1)  # rank 0 reaches 1 twice
    link = ll_link_bytes(wires)
    assert link.dispatch_fp8 == LinkLoad(sent=(to_1, to_0), received=(to_0, to_1))
    assert link.dispatch_fp8.bound_bytes == to_1 == 400
    assert link.dispatch_fp8.busiest == "rank 0 sending"
    # combine: each rank's weights to the other; rank 1 returns 2 partials of rank 0's tokens
    # (float32 for token 0, BF16 row for token 1), rank 0 one BF16 row of rank 1's token
    w0, w1 = 3 * 2 * 8 + 8, 1 * 2 * 8 + 8
    back_to_0, back_to_1 = (4 * 128 + 8) + (2 * 128 + 8), 2 * 128 + 8
    assert link.combine == LinkLoad(sent=(w0 + back_to_1, w1 + back_to_0),
                                    received=(w1 + back_to_0, w0 + back_to_1))  # fmt: skip
    assert link.combine.bound_bytes == 808 and link.combine.busiest == "rank 0 receiving"
    with pytest.raises(ValueError, match="wires\\[0\\]"):
        ll_link_bytes(wires[::-1])


def test_ll_wire_bytes_match_the_expectation_at_the_decode_shape() -> None:
    # top-8 of 16 experts at 4 ranks, uniform: entries on one rank are hypergeometric
    # (16, 4, 8): P(0) = P(4) = 495 / 12870, P(1) = P(3) = 3168 / 12870, P(2) = 5544 / 12870
    num_tokens, hidden, world = 4096, 7168, 4
    p = [495 / 12870, 3168 / 12870, 5544 / 12870, 3168 / 12870, 495 / 12870]
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(num_tokens, 16, generator=gen).topk(8, dim=1).indices
    wire = ll_wire_bytes(idx, 16, world, 0, hidden)
    peers = world - 1
    signals = peers * 8 * (1 + 4 + num_tokens)
    expected_fp8 = peers * num_tokens * (1 - p[0]) * (80 + 7168 + 224) + signals
    expected_partials = peers * num_tokens * (p[1] * (2 * hidden + 8) +
                                              (1 - p[0] - p[1]) * (4 * hidden + 8))  # fmt: skip
    assert wire.dispatch_fp8_sent == pytest.approx(expected_fp8, rel=0.01)
    assert wire.combine_partials_received == pytest.approx(expected_partials, rel=0.01)
    assert sum(wire.combine_weights) == peers * (num_tokens * 8 * 8 + 8)


def test_ll_wire_bytes_refuses_what_the_kernels_refuse() -> None:
    ok = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of world"):
        ll_wire_bytes(ok, 6, 4, 0, 128)
    with pytest.raises(ValueError, match="values must be in"):
        ll_wire_bytes(torch.tensor([[0, 8]]), 8, 2, 0, 128)
    with pytest.raises(ValueError, match="hidden 100"):
        ll_wire_bytes(ok, 8, 2, 0, 100)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ll_wire_bytes(ok, 8, 2, 2, 128)
    with pytest.raises(ValueError, match="max_topk 1"):
        ll_wire_bytes(ok, 8, 2, 0, 128, max_topk=1)
