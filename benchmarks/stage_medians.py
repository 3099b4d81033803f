"""Median of each host stage in EP_PROFILE_HOST lines ("ep <op> host us: a=1 b=2 total=3
start_ns=N pid=P"), and, for ops with an "agree" stage, how much of it is waiting for peers.

    python benchmarks/stage_medians.py LOG

Write LOG in append mode (``2>>LOG``): the ranks of a bench share its file, and appends keep
their lines whole (a plain ``2>LOG`` lets ranks overwrite each other's bytes; such lines are
skipped).

The k-th call of an op in each process is the same collective call (every rank makes the same
calls). Its entry is start_ns (the C++ op's start; the skew of the entries is what the ranks
bring from before the op: the Python layer, or how they left whatever preceded the call), its
arrival at the agreement start_ns plus the stages before "agree"; for each call
the last rank's arrival bounds the agreement from below, so "agree" = waiting for the last rank +
the exchange itself. Printed per op: the arrival skew (last - first arrival), the other ranks' wait
for the last one, what is left of "agree" once everyone is there, and per process how often it
was last; where the lines carry "agree_wait" (the part of "agree" spent waiting for the peers'
rows after posting its own), also the last rank's own "agree" and, of it, that wait: the rest
is its own work before posting and after reading. (start_ns is CLOCK_MONOTONIC: the processes must share a host.)
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"ep (.+?) host us:(.*)")
CELL = re.compile(r"(\S+?)=(\S+)")


def parse(path: str) -> list[tuple[str, dict[str, float], int | None, int | None]]:
    """(op, stage -> µs in order, start_ns, pid) of each well-formed line."""
    calls = []
    for line in open(path, errors="replace"):
        m = LINE.match(line.strip())
        if not m:
            continue
        try:
            cells = [(k, float(v)) for k, v in CELL.findall(m.group(2))]
        except ValueError:  # a mangled line (ranks writing one file without append mode)
            continue
        stages = {k: v for k, v in cells if k not in ("start_ns", "pid")}
        extra = dict(cells)
        if "total" not in stages:
            continue
        start = int(extra["start_ns"]) if "start_ns" in extra else None
        pid = int(extra["pid"]) if "pid" in extra else None
        calls.append((m.group(1), stages, start, pid))
    return calls


def medians(calls) -> None:
    stages: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for op, cells, _, _ in calls:
        for key, value in cells.items():
            stages[op][key].append(value)
    for op, parts in stages.items():
        cells = " ".join(f"{k}={statistics.median(v):.1f}" for k, v in parts.items())
        print(f"{op} (n={len(parts['total'])}, medians µs): {cells}")


def agreement_waits(calls) -> None:
    by_op: dict[str, dict[int, list[tuple[float, float, float | None, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for op, cells, start, pid in calls:
        if "agree" not in cells or start is None or pid is None:
            continue
        before = 0.0
        for key, value in cells.items():
            if key == "agree":
                break
            before += value
        entry = start / 1e3
        by_op[op][pid].append((entry + before, cells["agree"], cells.get("agree_wait"), entry))
    for op, per_pid in by_op.items():
        counts = {len(v) for v in per_pid.values()}
        if len(per_pid) < 2:
            continue
        if len(counts) != 1:
            print(f"{op}: processes logged different numbers of calls {sorted(counts)} "
                  "(lines lost?); arrivals not lined up")  # fmt: skip
            continue
        pids = sorted(per_pid)
        skews, entry_skews, waits, rest, last_agree, last_wait = [], [], [], [], [], []
        last_count = dict.fromkeys(pids, 0)
        for k in range(counts.pop()):
            arrivals = {p: per_pid[p][k][0] for p in pids}
            first, last = min(arrivals.values()), max(arrivals.values())
            skews.append(last - first)
            entries = [per_pid[p][k][3] for p in pids]
            entry_skews.append(max(entries) - min(entries))
            latest = max(arrivals, key=arrivals.get)
            last_count[latest] += 1
            last_agree.append(per_pid[latest][k][1])
            if per_pid[latest][k][2] is not None:
                last_wait.append(per_pid[latest][k][2])
            for p in pids:
                wait = last - arrivals[p]
                if wait > 0:  # the ranks that were not last
                    waits.append(wait)
                rest.append(per_pid[p][k][1] - wait)
        n = len(skews)
        lasts = ", ".join(f"pid {p} {100 * c / n:.0f}%" for p, c in last_count.items())
        print(f"{op} agreement ({n} calls x {len(pids)} processes, medians µs): C++ entry skew "
              f"{statistics.median(entry_skews):.1f}, arrival skew "
              f"{statistics.median(skews):.1f}, the others' wait for the last rank "
              f"{statistics.median(waits) if waits else 0.0:.1f}, "
              f"agree once all arrived {statistics.median(rest):.1f}; last to arrive: {lasts}")  # fmt: skip
        if last_wait:
            print(f"  the last rank's own agree {statistics.median(last_agree):.1f}, of it waiting "
                  f"for the peers' rows {statistics.median(last_wait):.1f}")  # fmt: skip


def main() -> None:
    calls = parse(sys.argv[1])
    medians(calls)
    agreement_waits(calls)


if __name__ == "__main__":
    main()
