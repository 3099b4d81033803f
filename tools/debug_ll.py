"""Minimal 2-rank CUDA low-latency dispatch+combine, one process per rank, for debuggers.

Usage: python tools/debug_ll.py RANK [PORT]   (start rank 1 and rank 0 separately)
"""

import datetime
import sys

import torch
import torch.distributed as dist

import ep_backend as ep

rank, port = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 29556
torch.cuda.set_device(rank % torch.cuda.device_count())
store = dist.TCPStore(
    "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group("ep", store=store, rank=rank, world_size=2)
x = torch.randn(64, 512, device="cuda").bfloat16()
idx = torch.randint(-1, 16, (64, 4), device="cuda")
w = torch.rand(64, 4, device="cuda")
print(rank, "start", flush=True)
out = ep.low_latency_dispatch(x, idx, 128, 16, use_fp8=False)
print(rank, "dispatch done", out.recv_count.tolist(), flush=True)
y = ep.low_latency_combine(out.recv_x, idx, w, out.handle)
print(rank, "combine done", y.shape, flush=True)
dist.destroy_process_group()
