"""Minimal 2-rank CUDA dispatch+combine, one process per rank: for debuggers (cuda-gdb, sanitizer).

Usage: python tools/debug_dispatch.py RANK [PORT]   (start rank 1 and rank 0 separately)
"""

import datetime
import sys

import torch
import torch.distributed as dist

import ep_backend as ep

rank, port = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 29555
torch.cuda.set_device(rank % torch.cuda.device_count())  # 2 ranks may share one GPU
store = dist.TCPStore(
    "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
)
dist.init_process_group("ep", store=store, rank=rank, world_size=2)
x = torch.randn(300 - 200 * rank, 256, device="cuda").bfloat16()
idx = torch.randint(-1, 8, (x.shape[0], 4), device="cuda")
out = ep.dispatch(x, idx, None, 8)
ref = ep.reference.dispatch(x.cpu(), idx.cpu(), None, 8)  # over Gloo: NCCL refuses shared GPUs
print(rank, "dispatch equal:", torch.equal(out.recv_x.cpu(), ref.recv_x), flush=True)
c = ep.combine(out.recv_x, out.handle)
r = ep.reference.combine(ref.recv_x, ref.handle)
print(rank, "combine equal:", torch.equal(c.combined_x.cpu(), r.combined_x), flush=True)
dist.destroy_process_group()
