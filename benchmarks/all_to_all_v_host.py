"""Host time per call of a small ``all_to_all_v`` against ``all_to_all_single`` and the bare
backend call: what the Python layer of the device-split API costs.

    python benchmarks/all_to_all_v_host.py [--ranks R] [--port P]

R ranks (default 2) on the visible GPUs (ranks may share one: host figures only). Each mode is
called 200 times back to back without a sync, after a host barrier, six rounds interleaved;
rank 0 prints the median µs per call of each mode.
"""

from __future__ import annotations

import argparse
import statistics
import time

import local_ranks
import torch
import torch.distributed as dist


def _worker(rank: int, world: int, port: int) -> None:
    import ep_backend as ep
    from ep_backend.bench import _host_barrier

    local_ranks.join_group(rank, world, port, timeout_s=120)
    dev = torch.device("cuda", torch.cuda.current_device())
    per_peer = 4096  # bytes
    inp = torch.ones(world * per_peer // 2, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(inp)
    splits = torch.full((world,), per_peer // 2, dtype=torch.int64, device=dev)
    backend = ep.get_backend()
    modes = {
        "dist.all_to_all_single": lambda: dist.all_to_all_single(out, inp),
        "ep.all_to_all_v(out=)": lambda: ep.all_to_all_v(inp, splits, out),
        "ep.all_to_all_v(capacity=)": lambda: ep.all_to_all_v(inp, splits, capacity=inp.shape[0]),
        "EPProcessGroup._all_to_all_v": lambda: backend._all_to_all_v(inp, splits, out, 1, True),
    }
    for f in modes.values():
        for _ in range(50):
            f()
    torch.cuda.synchronize()
    per_call: dict[str, list[float]] = {m: [] for m in modes}
    calls = 200
    for _ in range(6):
        for m, f in modes.items():
            _host_barrier()
            torch.cuda.synchronize()
            _host_barrier()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            per_call[m].append((time.perf_counter() - t) / calls * 1e6)
            torch.cuda.synchronize()
    if rank == 0:
        for m, samples in per_call.items():
            print(f"R={world} {m:30s} {statistics.median(samples):6.1f} µs per call", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29641)
    args = parser.parse_args()
    local_ranks.spawn(_worker, (args.ranks, args.port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
