"""One NVSHMEM session per process: buffers grow by free + malloc, groups come and go around it.

NVSHMEM is never finalised and re-initialised inside a process (after ``nvshmem_finalize`` a new
init keeps the first bootstrap and ignores the new unique id: NVIDIA/nvshmem issue #68; a
restart of that kind hung the internode spec test in its next dispatch). So:

* growing the low-latency buffers (M, then 2M, then 2H) frees the old symmetric region and
  allocates the new one in the same session; every call after each growth equals
  ``ep_backend.reference`` (dispatch bit for bit, combine within float32-accumulation
  tolerance), and the session keeps its PEs;
* a buffer setup that fails on one rank (a test hook, at the first call and at a growth) makes
  every rank raise naming it, instead of leaving its peers in ``nvshmem_malloc`` (no timeout),
  and the next call sets the buffers up and is exact;
* after ``ep_backend.abort`` a new group over the same ranks reuses the session (and frees the
  buffers the aborted group left), exactly; a group over other ranks (here: rank 0 alone, as
  after a peer died) is refused NVSHMEM with a reason and takes the ATen path, exactly.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_utils import gpu_world_size, run_distributed
from moe_helpers import (
    Mismatches,
    cuda_routing,
    ll_combine_beyond_tolerance,
    ll_valid_mask,
    nvshmem_built,
)

pytestmark = pytest.mark.gpu(min_gpus=2)

M, HIDDEN, TOPK = 32, 1024, 4


def _round_trip(
    ep: Any, ref: Any, group: Any, m: int, hidden: int, experts: int, seed: int, what: str
) -> list[str]:
    """One low-latency dispatch + combine on ``group`` against the reference."""
    mm = Mismatches(context=what)
    x, idx, w = cuda_routing(m, hidden, experts, TOPK, seed=seed)
    d = ep.low_latency_dispatch(x, idx, m, experts, use_fp8=False, group=group)
    e = ref.low_latency_dispatch(x.cpu(), idx.cpu(), m, experts, use_fp8=False, group=group)
    mm.bitwise(d.recv_count.cpu(), e.recv_count, "recv_count")
    mm.bitwise(d.handle.src_info.cpu(), e.handle.src_info, "src_info")
    mm.bitwise(d.handle.layout_range.cpu(), e.handle.layout_range, "layout_range")
    valid = ll_valid_mask(e.recv_count, e.recv_x.shape[1])  # slots past recv_count: unspecified
    mm.bitwise(d.recv_x.cpu()[valid], e.recv_x[valid], "recv_x (valid slots)")
    y = d.recv_x * 2
    out = ep.low_latency_combine(y, idx, w, d.handle, group=group)
    want = ref.low_latency_combine(e.recv_x * 2, idx.cpu(), w.cpu(), e.handle, group=group)
    magnitude = ref.low_latency_combine(
        (e.recv_x * 2).abs(), idx.cpu(), w.cpu().abs(), e.handle, group=group
    )
    bad = ll_combine_beyond_tolerance(out, want, magnitude, TOPK)
    failures = list(mm.items)
    if bad:
        failures.append(f"{what}: combine has {bad} outputs beyond tolerance")
    return failures


def _session(ep: Any) -> tuple[bool, int, int]:
    return tuple(ep._C._nvshmem_session())


def _growth_worker(rank: int, world: int) -> dict[str, Any]:
    import ep_backend as ep
    from ep_backend import reference as ref

    group = dist.new_group(backend="ep")
    experts = 4 * world
    out: dict[str, Any] = {"failures": [], "sessions": []}
    steps = [(M, HIDDEN, "M"), (2 * M, HIDDEN, "2M"), (2 * M, 2 * HIDDEN, "2M, 2H")]
    for i, (m, hidden, what) in enumerate(steps):
        for call in range(2):  # the call that grows the buffers, and one on them
            out["failures"] += _round_trip(
                ep, ref, group, m, hidden, experts, 100 * i + 10 * call + rank, f"{what} #{call}"
            )
        out["sessions"].append(_session(ep))
    out["transport"] = ep.get_backend(group).low_latency_transport
    torch.cuda.synchronize()
    dist.barrier()
    return out


def test_low_latency_buffers_grow_twice_in_one_session() -> None:
    if not nvshmem_built():
        pytest.skip("libep_nvshmem.so was not built: the low-latency ops run on ATen")
    world = gpu_world_size()
    for rank, r in enumerate(run_distributed(_growth_worker, world, backend="ep", timeout=240)):
        assert r["transport"] == "nvshmem", (rank, r["transport"])
        assert r["failures"] == [], (rank, r["failures"][:10])
        assert r["sessions"] == [(True, rank, world)] * 3, (rank, r["sessions"])


def _regroup_worker(rank: int, world: int) -> dict[str, Any]:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 4 * world
    timeout = datetime.timedelta(seconds=60)
    out: dict[str, Any] = {"failures": []}
    first = dist.new_group(backend="ep", timeout=timeout)
    out["failures"] += _round_trip(ep, ref, first, M, HIDDEN, experts, rank, "first group")
    out["first"] = ep.get_backend(first).low_latency_transport
    torch.cuda.synchronize()
    dist.barrier()
    ep.abort(first)  # its buffers are parked, not freed: a peer might be dead
    second = dist.new_group(backend="ep", timeout=timeout)
    out["failures"] += _round_trip(ep, ref, second, 2 * M, HIDDEN, experts, 7 + rank, "second")
    out["second"] = ep.get_backend(second).low_latency_transport
    torch.cuda.synchronize()
    dist.barrier()
    ep.abort(second)
    # Rank 0 alone, as survivors re-create a group without a rank that died: refused.
    alone = dist.new_group(ranks=[0], backend="ep", timeout=timeout)
    if rank == 0:
        out["failures"] += _round_trip(ep, ref, alone, M, HIDDEN, 4, 11, "rank 0 alone")
        out["alone"] = ep.get_backend(alone).low_latency_transport
    dist.barrier()
    third = dist.new_group(backend="ep", timeout=timeout)
    out["failures"] += _round_trip(ep, ref, third, M, 2 * HIDDEN, experts, 13 + rank, "third")
    out["third"] = ep.get_backend(third).low_latency_transport
    out["session"] = _session(ep)
    torch.cuda.synchronize()
    dist.barrier()
    return out


def test_groups_reuse_the_session_and_other_ranks_are_refused() -> None:
    if not nvshmem_built():
        pytest.skip("libep_nvshmem.so was not built: the low-latency ops run on ATen")
    world = gpu_world_size()
    for rank, r in enumerate(run_distributed(_regroup_worker, world, backend="ep", timeout=300)):
        assert r["failures"] == [], (rank, r["failures"][:10])
        for name in ("first", "second", "third"):
            assert r[name] == "nvshmem", (rank, name, r[name])
        assert r["session"] == (True, rank, world), (rank, r["session"])
        if rank == 0:
            assert r["alone"].startswith("aten"), r["alone"]
            assert f"PE 0 of {world}" in r["alone"] and "issue #68" in r["alone"], r["alone"]


def _failed_setup_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's buffer setup fails (the test hook), first at the group's first call, then at a
    growth: each time every rank must raise naming rank 1, and the next call be exact."""
    import time

    import ep_backend as ep
    from ep_backend import reference as ref

    group = dist.new_group(backend="ep", timeout=datetime.timedelta(seconds=60))
    experts = 4 * world
    out: dict[str, Any] = {"failures": [], "errors": [], "seconds": []}
    for i, m in enumerate((M, 2 * M)):  # the first setup, then a growth (a rebuild)
        if rank == 1:
            ep._C._fail_next_nvshmem_setup()
        x, idx, _ = cuda_routing(m, HIDDEN, experts, TOPK, seed=50 + rank)
        start = time.monotonic()
        try:
            ep.low_latency_dispatch(x, idx, m, experts, use_fp8=False, group=group)
            out["errors"].append(None)
        except RuntimeError as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")
        out["seconds"].append(time.monotonic() - start)
        out["failures"] += _round_trip(ep, ref, group, m, HIDDEN, experts, 60 + 10 * i + rank,
                                       f"after the failed setup #{i}")  # fmt: skip
    out["transport"] = ep.get_backend(group).low_latency_transport
    torch.cuda.synchronize()
    dist.barrier()
    return out


def test_a_setup_failing_on_one_rank_raises_on_every_rank_and_the_next_call_sets_up() -> None:
    if not nvshmem_built():
        pytest.skip("libep_nvshmem.so was not built: the low-latency ops run on ATen")
    world = gpu_world_size()
    results = run_distributed(_failed_setup_worker, world, backend="ep", timeout=240)
    for rank, r in enumerate(results):
        assert r["transport"] == "nvshmem", (rank, r["transport"])
        assert r["failures"] == [], (rank, r["failures"][:10])
        assert len(r["errors"]) == 2, (rank, r["errors"])
        for error, seconds in zip(r["errors"], r["seconds"], strict=True):
            assert error is not None, f"rank {rank} did not raise"
            assert "rank(s) 1 failed making the NVSHMEM buffers" in error, (rank, error)
            assert "injected by a test" in error, (rank, error)
            assert "Exception raised from" not in error, (rank, error)
            assert seconds < 30, (rank, seconds)
