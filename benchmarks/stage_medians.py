"""Median of each host stage in EP_PROFILE_HOST lines ("ep <op> host us: a=1 b=2 total=3")."""

import re
import statistics
import sys
from collections import defaultdict

stages: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"ep (.+?) host us:(.*)", line.strip())
    if not m:
        continue
    try:  # lines of two ranks can interleave: skip a mangled one
        cells = [(k, float(v)) for k, v in re.findall(r"(\S+?)=(\S+)", m.group(2))]
    except ValueError:
        continue
    for key, value in cells:
        if key == "start_ns":  # a timestamp, not a stage
            continue
        stages[m.group(1)][key].append(value)
for op, parts in stages.items():
    cells = " ".join(f"{k}={statistics.median(v):.1f}" for k, v in parts.items())
    print(f"{op} (n={len(parts['total'])}, medians µs): {cells}")
