"""Issue 43's targets as the bench reads them off its rows (ep_backend/_bench_targets.py)."""

from __future__ import annotations

import json

import pytest

from ep_backend._bench_targets import main, plot_targets, read_targets, targets_for


def _row(op: str, us: float, host_us: float = 0.0, limit_pct: float = 0.0, tokens: int = 4096):
    return {"op": op, "tokens": tokens, "us": us, "host_us": host_us, "limit_pct": limit_pct,
            "remote_gbps": 0.0, "logical_gbps": 0.0, "note": "", "call_us": 0.0}  # fmt: skip


ROWS = [
    _row("ep dispatch BF16", 476.0, host_us=221.8, limit_pct=105.5),
    _row("ep dispatch BF16", 50.0, host_us=10.0, limit_pct=20.0, tokens=128),  # a sweep row
    _row("ep dispatch FP8", 258.0, host_us=50.0, limit_pct=89.9),
    _row("ep combine BF16", 525.0, host_us=59.0, limit_pct=92.0),
    _row("ep loop: layout + dispatch + combine BF16", 1060.0),
    _row("bound: dispatch + combine bytes at the limit", 1000.0),
    _row("ll dispatch FP8 (graph, in step)", 21.0, tokens=128),
    _row("ll combine BF16 (graph, in step: pair - FP8 dispatch)", 27.0, tokens=128),
]


def test_targets_read_each_row_as_its_kind() -> None:
    got = {r.target.label: r for r in read_targets(ROWS, 4)}
    assert got["HT dispatch BF16, % of the 24-SM limit"].measured == 105.5  # largest T's row
    assert got["HT dispatch BF16, % of the 24-SM limit"].met
    assert not got["HT dispatch FP8, % of the limit"].met  # 89.9 < 90
    assert got["HT combine BF16, % of the limit"].met  # 92.0 >= 92: the bound is inclusive
    loop = got["HT loop, x its bytes at the limit"]
    assert loop.measured == pytest.approx(1.06) and not loop.met
    assert got["host: combine, µs"].met and not got["host: dispatch BF16, µs"].met
    assert got["LL FP8 dispatch, graph in step, µs"].met  # 21 <= 22 at EP4
    assert got["LL combine, graph in step, µs"].met  # 27 <= 28
    # rows the run did not time are left out, not counted as met or missed
    assert "host: layout, µs" not in got and "LL eager loop, µs per step" not in got


def test_low_latency_targets_depend_on_the_group_size() -> None:
    ep2 = {t.label: t.value for t in targets_for(2)}
    ep4 = {t.label: t.value for t in targets_for(4)}
    assert ep2["LL FP8 dispatch, graph in step, µs"] == 20.0
    assert ep4["LL FP8 dispatch, graph in step, µs"] == 22.0
    assert ep2["LL combine, graph in step, µs"] == 25.0
    assert ep4["LL combine, graph in step, µs"] == 28.0
    got = {r.target.label: r for r in read_targets(ROWS, 2)}
    assert not got["LL FP8 dispatch, graph in step, µs"].met  # 21 > 20 at EP2
    assert not got["LL combine, graph in step, µs"].met  # 27 > 25


def test_margin_is_one_at_the_target() -> None:
    rows = [_row("ep dispatch FP8", 1.0, limit_pct=90.0), _row("ep layout", 1.0, host_us=60.0)]
    for r in read_targets(rows, 4):
        assert r.met and r.margin == pytest.approx(1.0), r


def test_command_line_prints_and_plots(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(ROWS))
    assert main([str(path), "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "HT dispatch FP8, % of the limit" in out and "NOT MET" in out
    assert not plot_targets([], tmp_path / "none.png", "empty")
    pytest.importorskip("matplotlib")  # the bench extra
    png = tmp_path / "targets.png"
    assert main([str(path), "--ranks", "4", "--png", str(png)]) == 0
    assert png.stat().st_size > 1000
