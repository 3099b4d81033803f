"""Host-time breakdown of the NVLink-path dispatch/combine (2 ranks, one GPU each).

Usage: EP_PROFILE_HOST=1 python benchmarks/profile_host.py [T] [fp8]   (fp8: FP8 x with scales)
Each call prints "ep <op> host us: stage=µs ... total=µs" on stderr (see moe_intranode.cpp).
"""

import sys
import time

import local_ranks
import torch
import torch.distributed as dist


def worker(rank: int, tokens: int, port: int, fp8: bool) -> None:
    import ep_backend as ep

    local_ranks.join_group(rank, 2, port)
    x, idx, _ = local_ranks.standard_inputs(tokens, rank)
    scales = None
    if fp8:
        x, scales = ep.reference.quantize_fp8_per128(x)
    for i in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ep.dispatch(x, idx, None, 256, x_scales=scales)
        t1 = time.perf_counter()
        ep.combine(out.recv_x.bfloat16() if fp8 else out.recv_x, out.handle)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        print(f"rank {rank} call {i}: dispatch {1e6 * (t1 - t0):.0f} us, combine "
              f"{1e6 * (t2 - t1):.0f} us, then sync {1e6 * (t3 - t2):.0f} us",
              file=sys.stderr, flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    fp8 = len(sys.argv) > 2 and sys.argv[2] == "fp8"
    local_ranks.spawn(worker, (tokens, 29577, fp8))
