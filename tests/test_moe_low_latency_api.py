"""Low-latency API details on CPU ranks: the zero-copy combine buffer and the recv hook."""

from __future__ import annotations

import torch
from _dist_utils import run_distributed


def _zero_copy_and_hook(rank: int, world: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    failures: list[str] = []
    g = torch.Generator().manual_seed(5 + rank)
    m, num_experts, hidden = 16, 4 * world, 256
    x = torch.randn(11 + rank, hidden, generator=g).bfloat16()
    idx = torch.randint(-1, num_experts, (x.shape[0], 3), generator=g)
    w = torch.rand(x.shape[0], 3, generator=g)
    stats = torch.zeros(num_experts // world, dtype=torch.int32)
    d = ep.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False, return_recv_hook=True,
                                cumulative_local_expert_recv_stats=stats)  # fmt: skip
    if int(stats.sum()) != 0:
        failures.append("stats changed before the hook ran")
    d.hook()
    e = ref.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False)
    if not torch.equal(stats, e.recv_count):
        failures.append(f"stats after the hook {stats.tolist()} != {e.recv_count.tolist()}")
    if not torch.equal(d.recv_x, e.recv_x):
        failures.append("hook-mode recv_x")
    y = (d.recv_x.float() * 0.5).bfloat16()
    buf = ep.get_low_latency_combine_buffer(d.handle)
    if buf.dtype != torch.bfloat16 or buf.shape != d.recv_x.shape:
        failures.append(f"combine buffer {buf.dtype} {tuple(buf.shape)}")
    buf.copy_(y)
    got = ep.low_latency_combine(buf, idx, w, d.handle)
    want = ref.low_latency_combine(y, idx, w, e.handle)
    if not torch.equal(got, want):
        failures.append("zero-copy combine differs from the reference")
    return failures


def test_zero_copy_buffer_and_recv_hook_on_cpu() -> None:
    for rank, failures in enumerate(run_distributed(_zero_copy_and_hook, 2, backend="ep")):
        assert failures == [], (rank, failures)
