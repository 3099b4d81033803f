"""Copy-engine throughput between GPU 0 and GPU 1 (cudaMemcpyPeerAsync through torch), one
direction and both at once; a lead for dispatch/combine designs that move rows without SMs.

Usage: python scripts/ce_peer_copy.py [MiB] [reps]
"""

from __future__ import annotations

import statistics
import sys

import torch


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    n = mib << 20
    a = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    b = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]

    def run(directions: list[int]) -> float:
        times = []
        for _ in range(reps + 3):
            for d in (0, 1):
                torch.cuda.synchronize(d)
            ev = {}
            for d in directions:  # copy a[d] (on GPU d) into b[1-d] (on the peer), issued on d
                with torch.cuda.stream(streams[d]):
                    s, e = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    s.record()
                    b[1 - d].copy_(a[d], non_blocking=True)
                    e.record()
                    ev[d] = (s, e)
            for d in directions:
                ev[d][1].synchronize()
            times.append(max(s.elapsed_time(e) for s, e in ev.values()) * 1e3)
        return statistics.median(times[3:])

    for name, dirs in (("0->1", [0]), ("1->0", [1]), ("both at once", [0, 1])):
        us = run(dirs)
        print(f"CE {name:13s} {mib} MiB: {us:8.1f} us  {n / us / 1e3:6.1f} GB/s per direction")


if __name__ == "__main__":
    main()
