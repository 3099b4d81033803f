"""Probe: host cost of kernel launches, idle and behind a busy stream (diagnoses launch blocking)."""

import os
import time

import torch

print({k: v for k, v in os.environ.items() if "CUDA" in k or "NCCL" in k or "TORCH" in k})
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(1000):
    x.add_(1)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"idle: 1000 launches {1e3 * (t1 - t0):.2f} ms host")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    a = (a @ a).clamp_(-1, 1)
t1 = time.perf_counter()
for _ in range(200):
    x.add_(1)
t2 = time.perf_counter()
busy = not torch.cuda.current_stream().query()
torch.cuda.synchronize()
t3 = time.perf_counter()
print(
    f"20 GEMMs launched in {1e3 * (t1 - t0):.1f} ms, 200 small launches behind them "
    f"{1e3 * (t2 - t1):.1f} ms, stream busy after: {busy}, drain {1e3 * (t3 - t2):.1f} ms"
)
