"""A/B of dispatch modes, interleaved call by call (2 ranks, one GPU each), timed as the bench.

Usage: [EP_AB_PIN=N] python benchmarks/ab_dispatch.py [T] [iters]   (N: pin each rank to N cores)

Each round times one BF16 dispatch per mode (overlapped: the default; host-first:
Options.overlap_dispatch_host_wait=False), in rotating order, with the bench's L2 flush and
start-time barrier before each call; the medians (max over ranks) come out side by side, so
drift of the machine hits every mode alike.
"""

import os
import statistics
import sys
import time

import local_ranks
import torch
import torch.distributed as dist


def worker(rank: int, tokens: int, iters: int, port: int) -> None:
    import ep_backend as ep
    from ep_backend.bench import _host_barrier

    pin = int(os.environ.get("EP_AB_PIN", "0"))  # > 0: this many cores per rank, disjoint
    if pin > 0:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[1 + rank * pin : 1 + (rank + 1) * pin])
    local_ranks.join_group(rank, 2, port)
    x, idx, w = local_ranks.standard_inputs(tokens, rank)
    options = ep.get_backend().options
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    modes = {"overlapped": True, "host-first": False}  # Options.overlap_dispatch_host_wait
    samples: dict[str, list[float]] = {m: [] for m in modes}
    host: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(iters + 3):
        order = list(modes)[i % len(modes) :] + list(modes)[: i % len(modes)]  # rotate
        for mode in order:
            options.overlap_dispatch_host_wait = modes[mode]
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _host_barrier()
            start.record()
            h0 = time.perf_counter()
            ep.dispatch(x, idx, w, 256)
            h1 = time.perf_counter()
            end.record()
            end.synchronize()
            if i >= 3:  # warm-up rounds
                samples[mode].append(start.elapsed_time(end) * 1e3)
                host[mode].append((h1 - h0) * 1e6)
    med = torch.tensor([statistics.median(samples[m]) for m in modes]
                       + [statistics.median(host[m]) for m in modes], dtype=torch.float64)  # fmt: skip
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        for j, mode in enumerate(modes):
            print(f"ab dispatch BF16 T={tokens} pin={pin} {mode:10s}: {med[j]:7.1f} us "
                  f"(host {med[j + len(modes)]:6.1f} us), median of {iters}, max over ranks",
                  flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    local_ranks.spawn(worker, (tokens, iters, 29579))
