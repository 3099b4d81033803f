"""Per-block timeline of one NVLink all-to-all call: where its sender and receiver blocks wait.

    python benchmarks/a2a_trace.py run R MIB DIR     # R ranks, MIB per peer, 12 back-to-back calls
    python benchmarks/a2a_trace.py report DIR        # one summary per rank's trace in DIR

Needs the instrumented kernel of ``benchmarks/a2a_trace.sh`` (``benchmarks/a2a_trace.patch``, never
in a production build), which writes each rank's trace of one call to ``DIR`` when
``EP_A2A_TRACE_CALL`` names the call (``run`` sets it to the 10th: the ranks are in step by then).
Timestamps are each GPU's %globaltimer, so one rank's blocks compare with each other; across
ranks they are only roughly aligned.

Per rank the report gives the kernel's span; for the sender blocks, per chunk (medians): the wait
for a free slot (its receiver's credit), the copy into the peer's staging slot, and the
system-scope fence + flag; when the lanes ended (min / median / max) and the share of sender time
left idle while the last lane of its pair still ran; per pair (destination), when its lanes
ended; for the receiver blocks, the share of time spent waiting for a flag and the copy per chunk.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import numpy as np

HEADER_WORDS = 8


def _worker(rank: int, world: int, mib: int, out: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      EP_A2A_TRACE_CALL="10", EP_A2A_TRACE_DIR=out)  # fmt: skip
    torch.cuda.set_device(rank)
    import ep_backend  # noqa: F401 - registers "ep"

    dist.init_process_group("ep", rank=rank, world_size=world)
    rows = (mib << 20) // 2 // 2048
    x = torch.randn(world * rows, 2048, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(12):  # the 11th launch writes the 10th's trace
        dist.all_to_all_single(y, x)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, mib: int, out: str) -> None:
    import torch.multiprocessing as mp

    Path(out).mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, mib, str(Path(out).resolve()), 29000 + os.getpid() % 1000),
             nprocs=world)  # fmt: skip


def _per_chunk(row: np.ndarray, slots: int, sender: bool) -> list[tuple[int, int, int]]:
    """(wait, copy, fence) ns per chunk of one block (fence 0 for receivers)."""
    out = []
    k = 0
    while 4 + 3 * k < slots - 1 and row[2 + 3 * k] > 0 and row[3 + 3 * k] > 0:
        prev = (row[4 + 3 * (k - 1)] if sender else row[3 + 3 * (k - 1)]) if k else row[1]
        fence = int(row[4 + 3 * k] - row[3 + 3 * k]) if sender else 0
        out.append((int(row[2 + 3 * k] - prev), int(row[3 + 3 * k] - row[2 + 3 * k]), fence))
        k += 1
    return out


def report(path: Path) -> list[str]:
    raw = np.fromfile(path, dtype=np.int64)
    rank, world, lanes, blocks, slots, per_peer = (int(v) for v in raw[:6])
    trace = raw[HEADER_WORDS:].reshape(blocks, slots)
    t0 = trace[:, 0][trace[:, 0] > 0].min()
    pairs = (world - 1) * lanes
    span = (trace[:, slots - 1].max() - t0) / 1e3
    lines = [f"rank {rank}: R = {world}, {lanes} lanes a pair, {per_peer / 2**20:.0f} MiB a peer; "
             f"kernel span {span:.0f} µs ({per_peer * (world - 1) / span / 1e3:.0f} GB/s out)"]  # fmt: skip
    chunks = [_per_chunk(trace[b], slots, True) for b in range(pairs)]
    flat = [c for per in chunks for c in per]
    if flat:
        wait, copy, fence = (statistics.median(c[i] for c in flat) / 1e3 for i in range(3))
        ends = (trace[:pairs, slots - 1] - t0) / 1e3
        idle = 0.0
        for p in range(world - 1):
            pe = ends[p * lanes : (p + 1) * lanes]
            idle += float((pe.max() - pe).sum())
        idle /= float(ends.max()) * pairs
        lines.append(f"  senders: {len(flat) / pairs:.1f} chunks a lane; per chunk: slot wait "
                     f"{wait:.1f}, copy {copy:.1f}, fence + flag {fence:.1f} µs; lanes ended "
                     f"{ends.min():.0f} / {np.median(ends):.0f} / {ends.max():.0f} µs; "
                     f"{100 * idle:.0f}% of sender time idle behind its pair's last lane")  # fmt: skip
        for p in range(world - 1):
            pe = ends[p * lanes : (p + 1) * lanes]
            lines.append(f"    pair {p} (to rank {(rank + 1 + p) % world}): lanes ended "
                         f"{pe.min():.0f}..{pe.max():.0f} µs")  # fmt: skip
    recv = [c for b in range(pairs, 2 * pairs) for c in _per_chunk(trace[b], slots, False)]
    if recv:
        waited = sum(c[0] for c in recv) / max(1, sum(c[0] + c[1] for c in recv))
        lines.append(f"  receivers: {100 * waited:.0f}% of their time waiting for a flag; "
                     f"copy {statistics.median(c[1] for c in recv) / 1e3:.1f} µs a chunk")  # fmt: skip
    return lines


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        files = sorted(Path(sys.argv[2]).glob("a2a_trace_r*.bin"))
        if not files:
            raise SystemExit(f"no a2a_trace_r*.bin in {sys.argv[2]}")
        for f in files:
            print("\n".join(report(f)))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
