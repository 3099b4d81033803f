"""Issue 43's targets read off the bench's rows: a table the bench prints and a plot.

Each target names the bench row it reads and how:

* ``min_pct``: the row's "% limit" (remote GB/s over the push limit at its SM budget) must be at
  least the target (high-throughput dispatch, FP8 dispatch, combine);
* ``max_bound``: the row's time over the time of the bound row (its bytes at the limit) must be
  at most the target (the loop of layout + dispatch + combine);
* ``max_us``: the row's time must be at most the target in µs (the low-latency rows, whose
  targets are latencies);
* ``max_host_us``: the row's host time (the CPU's time of one call on an idle GPU) must be at most
  the target in µs.

The low-latency targets depend on the group size: EP2 keeps its 20 / 25 µs, EP4 and larger have
22 / 28 µs. A target whose row is missing (a section not run, a row not timed) is left out. The
plot draws each target's margin, normalised so that 1 is the target and above 1 is met.

``python -m ep_backend._bench_targets BENCH_JSON [...] --ranks R [--png PATH] [--title TEXT]``
reads one or more ``bench.json`` files (e.g. the HT and the LL run of one machine).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ep_backend._pyplot import pyplot

__all__ = ["Target", "TargetResult", "plot_targets", "read_targets", "targets_for"]


@dataclass(frozen=True)
class Target:
    """One of issue 43's targets: ``row`` read as ``kind`` against ``value``."""

    label: str
    row: str
    kind: str  # "min_pct" | "max_bound" | "max_us" | "max_host_us"
    value: float
    bound_row: str = ""  # max_bound: the row whose time is the bound


@dataclass(frozen=True)
class TargetResult:
    """A target and what the rows gave: ``measured`` in the target's unit, ``met`` or not."""

    target: Target
    measured: float
    met: bool

    @property
    def margin(self) -> float:
        """Measured against the target, > 1 when met with room (``min``: measured / target,
        ``max``: target / measured)."""
        if self.target.kind == "min_pct":
            return self.measured / self.target.value
        return self.target.value / self.measured if self.measured > 0 else float("inf")


_LOOP = "ep loop: layout + dispatch + combine BF16"
_BOUND = "bound: dispatch + combine bytes at the limit"
_LL_FP8 = "ll dispatch FP8 (graph, in step)"
_LL_COMBINE = "ll combine BF16 (graph, in step: pair - FP8 dispatch)"
_LL_COMBINE_BF16P = "ll combine BF16, BF16 partials (graph, in step: pair - FP8 dispatch)"
_LL_LOOP = "ll dispatch FP8 + combine BF16"
_LL_LOOP_BF16P = "ll dispatch FP8 + combine BF16, BF16 partials"


def targets_for(num_ranks: int) -> list[Target]:
    """Issue 43's targets at ``num_ranks`` ranks (the low-latency ones depend on it)."""
    ll_dispatch, ll_combine = (20.0, 25.0) if num_ranks <= 2 else (22.0, 28.0)
    return [
        Target("HT dispatch BF16, % of the 24-SM limit", "ep dispatch BF16", "min_pct", 95.0),
        Target("HT dispatch FP8, % of the limit", "ep dispatch FP8", "min_pct", 90.0),
        Target("HT combine BF16, % of the limit", "ep combine BF16", "min_pct", 92.0),
        Target("HT loop, x its bytes at the limit", _LOOP, "max_bound", 1.05, _BOUND),
        Target("host: layout, µs", "ep layout", "max_host_us", 60.0),
        Target("host: dispatch BF16, µs", "ep dispatch BF16", "max_host_us", 60.0),
        Target("host: cached dispatch, µs", "ep cached dispatch BF16", "max_host_us", 60.0),
        Target("host: combine, µs", "ep combine BF16", "max_host_us", 60.0),
        Target("LL FP8 dispatch, graph in step, µs", _LL_FP8, "max_us", ll_dispatch),
        Target("LL combine, graph in step, µs", _LL_COMBINE, "max_us", ll_combine),
        Target("LL combine, BF16 partials, µs", _LL_COMBINE_BF16P, "max_us", ll_combine),
        Target("LL eager loop, µs per step", _LL_LOOP, "max_us", 60.0),
        Target("LL eager loop, BF16 partials, µs", _LL_LOOP_BF16P, "max_us", 60.0),
    ]


def read_targets(rows: list[dict], num_ranks: int) -> list[TargetResult]:
    """Each target of ``targets_for(num_ranks)`` whose rows are in ``rows`` (the bench's JSON
    rows at the standard shapes; a row timed at several T counts at its largest T)."""
    by_op: dict[str, dict] = {}
    for r in rows:
        if r.get("us", 0) > 0 and (r["op"] not in by_op or r["tokens"] > by_op[r["op"]]["tokens"]):
            by_op[r["op"]] = r
    results = []
    for t in targets_for(num_ranks):
        row = by_op.get(t.row)
        if row is None:
            continue
        if t.kind == "min_pct":
            if not row.get("limit_pct"):
                continue
            measured = float(row["limit_pct"])
            met = measured >= t.value
        elif t.kind == "max_bound":
            bound = by_op.get(t.bound_row)
            if bound is None:
                continue
            measured = row["us"] / bound["us"]
            met = measured <= t.value
        elif t.kind == "max_host_us":
            measured = float(row["host_us"])
            met = measured <= t.value
        else:
            measured = float(row["us"])
            met = measured <= t.value
        results.append(TargetResult(t, measured, met))
    return results


def format_targets(results: list[TargetResult]) -> list[str]:
    """One line per target: label, measured, the target, met or not."""
    lines = []
    for r in results:
        t = r.target
        sign = ">=" if t.kind == "min_pct" else "<="
        unit = "x" if t.kind == "max_bound" else ("%" if t.kind == "min_pct" else " µs")
        lines.append(f"  {t.label:40s} {r.measured:9.2f}{unit:3s} target {sign} {t.value:g}{unit}"
                     f"  {'met' if r.met else 'NOT MET'}")  # fmt: skip
    return lines


def plot_targets(results: list[TargetResult], path: Path, title: str) -> bool:
    """A bar per target, its margin (1 = the target; above 1 met). False without matplotlib or
    targets."""
    if not results:
        return False
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(results) + 1.2))
    labels = [r.target.label for r in results]
    margins = [min(r.margin, 3.0) for r in results]
    colors = ["tab:green" if r.met else "tab:red" for r in results]
    ax.barh(range(len(results)), margins, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(results)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("measured against the target (1 = the target; right of it: met)")
    ax.set_title(title, fontsize=10)
    for i, r in enumerate(results):
        text = f"{r.measured:.3f}" if r.target.kind == "max_bound" else f"{r.measured:.1f}"
        ax.text(margins[i] + 0.02, i, text, va="center", fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Issue 43's targets from bench.json files.")
    parser.add_argument("json", nargs="+", help="bench.json files of one machine and commit")
    parser.add_argument("--ranks", type=int, required=True, help="the group size they ran at")
    parser.add_argument("--png", type=str, default="", help="write the plot here")
    parser.add_argument("--title", type=str, default="", help="the plot's title")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for name in args.json:
        rows += json.loads(Path(name).read_text())
    results = read_targets(rows, args.ranks)
    print(f"issue 43 targets at EP{args.ranks}:")
    print("\n".join(format_targets(results)))
    if args.png:
        title = args.title or f"issue 43 targets, EP{args.ranks}"
        if not plot_targets(results, Path(args.png), title):
            print("no plot: matplotlib missing or no target rows")
            return 1
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
