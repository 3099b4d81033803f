"""Rank masking of the low-latency ops: the live ranks go on without a rank that stopped.

Each run: every rank makes ``STEPS_TOGETHER`` low-latency dispatch + combine calls, checked
against ``ep_backend.reference`` (no mask); then the last rank stops calling, and the others
mask it (explicitly with ``low_latency_update_mask``, or automatically: ``low_latency_auto_mask``
masks it when it misses the next call) and make ``STEPS_MASKED`` more calls, checked against the
reference with ``mask=[last]`` (which the stopped rank does not call either). On CPU the ATen
path is checked bit for bit; on CUDA the NVSHMEM kernels (dispatch bitwise, combine within
float32-accumulation tolerance; with ``Options.low_latency_combine_bf16_partials`` bitwise the
reference's model of them, on both paths). The reference runs on CPU copies over a side Gloo
group, where the stopped rank also waits until the others are done. Also: argument checks, the
deep_ep facade's ``*_mask_buffer`` methods, and ranks that disagree on the mask raising on every
live rank.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed
from moe_helpers import Mismatches, compare_ll_dispatch, single_thread

STEPS_TOGETHER = 2
STEPS_MASKED = 3
AUTO_MASK_S = 1.5
HIDDEN = 256
TOPK = 4
MAX_TOKENS = 16


def _inputs(rank: int, step: int, world: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7919 * step + rank)
    num_tokens = (step + rank) % MAX_TOKENS + 1
    x = torch.randn((num_tokens, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.randint(-1, 4 * world, (num_tokens, TOPK), generator=gen)
    # distinct experts per token (at most M rows from one rank to one expert)
    idx = torch.where(
        torch.arange(TOPK).expand(num_tokens, TOPK) < TOPK - 1,
        (idx.abs() + torch.arange(TOPK) * (4 * world // TOPK)) % (4 * world),
        idx,
    )
    weights = torch.rand((num_tokens, TOPK), generator=gen)
    return x.to(device), idx.to(device), weights.to(device)


def _expert(y: torch.Tensor) -> torch.Tensor:
    return (y.float() * 1.5 - 0.25).to(torch.bfloat16)


def _step(
    ep: Any, ref: Any, group: Any, ref_group: Any, rank: int, world: int, step: int,
    device: torch.device, mask: list[int] | None, m: Mismatches,
) -> None:  # fmt: skip
    # The reference runs on CPU copies over ``ref_group`` (Gloo), so that it shares nothing
    # with the ep kernels it checks (no NCCL point-to-point, no CUDA stream).
    x, idx, w = _inputs(rank, step, world, torch.device("cpu"))
    xd, idxd, wd = x.to(device), idx.to(device), w.to(device)
    experts = 4 * world
    for fp8 in (False, True):
        got = ep.low_latency_dispatch(xd, idxd, MAX_TOKENS, experts, use_fp8=fp8, group=group)
        want = ref.low_latency_dispatch(x, idx, MAX_TOKENS, experts, use_fp8=fp8,
                                        group=ref_group, mask=mask)  # fmt: skip
        compare_ll_dispatch(m, got, want)
    got = ep.low_latency_dispatch(xd, idxd, MAX_TOKENS, experts, use_fp8=False, group=group)
    want = ref.low_latency_dispatch(x, idx, MAX_TOKENS, experts, use_fp8=False, group=ref_group,
                                    mask=mask)  # fmt: skip
    y = _expert(want.recv_x)
    out = ep.low_latency_combine(y.to(device), idxd, wd, got.handle, group=group)
    expected = ref.low_latency_combine(y, idx, w, want.handle, group=ref_group, mask=mask)
    if device.type == "cpu":
        m.bitwise(out, expected, f"combine step {step}")
    else:
        from moe_helpers import ll_combine_beyond_tolerance

        magnitude = ref.low_latency_combine(y.abs(), idx, w.abs(), want.handle, group=ref_group,
                                            mask=mask)  # fmt: skip
        bad = ll_combine_beyond_tolerance(out, expected, magnitude, TOPK)
        m.check(bad == 0, f"combine step {step}: {bad} outputs beyond tolerance")
    # BF16 partials: the same bits on either path (the reference's model of the kernels).
    options = ep.get_backend(group).options
    options.low_latency_combine_bf16_partials = True
    try:
        got = ep.low_latency_dispatch(xd, idxd, MAX_TOKENS, experts, use_fp8=False, group=group)
        out = ep.low_latency_combine(y.to(device), idxd, wd, got.handle, group=group)
    finally:
        options.low_latency_combine_bf16_partials = False
    expected = ref.low_latency_combine(y, idx, w, want.handle, group=ref_group, mask=mask,
                                       per_rank_partials=torch.bfloat16)  # fmt: skip
    m.bitwise(out, expected, f"combine with BF16 partials, step {step}")


def _mask_worker(rank: int, world: int, how: str, device_type: str) -> dict[str, Any]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else (
        torch.device("cpu"))  # fmt: skip
    side = dist.new_group(backend="gloo")  # the reference's group; the stopped rank waits there
    group = dist.new_group(backend="ep", timeout=datetime.timedelta(seconds=60))
    stopped = world - 1
    out: dict[str, Any] = {"mismatches": [], "query": None, "masked_seconds": []}
    m = Mismatches(context=f"rank {rank}")
    if how == "auto":
        ep.low_latency_auto_mask(AUTO_MASK_S, group=group)
    for step in range(STEPS_TOGETHER):
        _step(ep, ref, group, side, rank, world, step, device, None, m)
    if rank != stopped:
        if how == "explicit":
            ep.low_latency_update_mask(stopped, group=group)
        for step in range(STEPS_TOGETHER, STEPS_TOGETHER + STEPS_MASKED):
            start = time.monotonic()
            _step(ep, ref, group, side, rank, world, step, device, [stopped], m)
            out["masked_seconds"].append(time.monotonic() - start)
        out["query"] = ep.low_latency_query_mask(group)
        if device_type == "cuda":
            torch.cuda.synchronize()
            out["transport"] = ep.get_backend(group).low_latency_transport
    dist.barrier(group=side)
    out["mismatches"] = m.items
    return out


def _check_masked_run(res: list[dict[str, Any]], how: str) -> None:
    world = len(res)
    for rank, r in enumerate(res):
        assert r["mismatches"] == [], r["mismatches"]
        if rank == world - 1:
            continue
        assert r["query"] == [world - 1], r["query"]
        if how == "auto":  # the first masked call waited for the auto-mask timeout, no more
            assert r["masked_seconds"][0] >= AUTO_MASK_S * 0.9, r["masked_seconds"]
            assert max(r["masked_seconds"][1:]) < AUTO_MASK_S, r["masked_seconds"]


@pytest.mark.parametrize("how", ["explicit", "auto"])
def test_live_ranks_go_on_without_a_masked_rank_cpu(how: str) -> None:
    res = run_distributed(_mask_worker, 3, how, "cpu", backend="ep", timeout=180)
    _check_masked_run(res, how)


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("how", ["explicit", "auto"])
def test_live_ranks_go_on_without_a_masked_rank_cuda(how: str) -> None:
    from _dist_utils import gpu_world_size
    from moe_helpers import nvshmem_built

    res = run_distributed(_mask_worker, gpu_world_size(), how, "cuda", backend="ep", timeout=300)
    _check_masked_run(res, how)
    if nvshmem_built():
        for r in res[:-1]:
            assert r["transport"] == "nvshmem", r["transport"]


def _arguments_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep

    seen = []
    for call, exc in (
        (lambda: ep.low_latency_update_mask(rank), ValueError),  # itself
        (lambda: ep.low_latency_update_mask(world), ValueError),
        (lambda: ep.low_latency_update_mask("1"), TypeError),
        (lambda: ep.low_latency_update_mask(1 - rank, masked=1), TypeError),
        (lambda: ep.low_latency_auto_mask(0.0), ValueError),
        (lambda: ep.low_latency_auto_mask("1"), TypeError),
        (lambda: ep.low_latency_auto_mask(1e-4), ValueError),  # under a millisecond
        (lambda: ep.low_latency_auto_mask(float("nan")), ValueError),
        (lambda: ep.low_latency_auto_mask(float("inf")), ValueError),
        (lambda: ep.low_latency_auto_mask(1e7), ValueError),  # past steady_clock's int64 ns
        # A list with one bad rank leaves the mask as it was (the query below sees nothing).
        (lambda: ep.low_latency_update_mask([1 - rank, world]), ValueError),
        (lambda: ep.low_latency_update_mask([1 - rank, rank]), ValueError),
    ):
        try:
            call()
            seen.append("no error")
        except exc:
            seen.append(exc.__name__)
    seen.append(str(ep.low_latency_query_mask()))
    ep.low_latency_update_mask([1 - rank])
    seen.append(str(ep.low_latency_query_mask()))
    ep.low_latency_update_mask(1 - rank, masked=False)
    seen.append(str(ep.low_latency_query_mask()))
    ep.low_latency_update_mask(1 - rank)
    ep.low_latency_clean_mask()
    seen.append(str(ep.low_latency_query_mask()))
    return seen


def test_mask_arguments_are_checked() -> None:
    for rank, seen in enumerate(run_distributed(_arguments_worker, 2, backend="ep", timeout=60)):
        assert seen[:12] == ["ValueError", "ValueError", "TypeError", "TypeError", "ValueError",
                             "TypeError"] + ["ValueError"] * 6, seen  # fmt: skip
        assert seen[12:] == ["[]", str([1 - rank]), "[]", "[]"], seen


def _disagree_worker(rank: int, world: int) -> str:
    """Rank 0 masks rank 2; rank 1 masks nothing but auto-masks: they must not pair silently."""
    import ep_backend as ep

    single_thread()
    side = dist.new_group(backend="gloo")
    group = dist.new_group(backend="ep", timeout=datetime.timedelta(seconds=30))
    message = "no error"
    if rank == 0:
        ep.low_latency_update_mask(2, group=group)
    if rank == 1:
        ep.low_latency_auto_mask(1.0, group=group)
    if rank != 2:
        x, idx, _ = _inputs(rank, 0, world, torch.device("cpu"))
        idx = torch.where(idx >= 8, -1, idx)  # nothing for rank 2's experts
        try:
            ep.low_latency_dispatch(x, idx, MAX_TOKENS, 4 * world, use_fp8=False, group=group)
        except RuntimeError as exc:
            message = str(exc)
    dist.barrier(group=side)
    return message


def test_ranks_that_disagree_on_the_mask_raise() -> None:
    res = run_distributed(_disagree_worker, 3, backend="ep", timeout=120)
    for message in res[:2]:
        assert "disagree on the masked ranks" in message, message


def _deep_ep_worker(rank: int, world: int, device_type: str = "cpu") -> list[str]:
    from ep_backend import deep_ep
    from ep_backend import reference as ref

    single_thread()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else (
        torch.device("cpu"))  # fmt: skip
    side = dist.new_group(backend="gloo")
    # enable_shrink turns auto-masking on before the first call: that call builds the NVSHMEM
    # buffers, which a masked call cannot (every rank builds them together).
    buffer = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True,
                            explicitly_destroy=True)  # fmt: skip
    m = Mismatches(context=f"deep_ep rank {rank}")
    status = torch.full((world,), 7, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    m.bitwise(status, torch.zeros(world, dtype=torch.int32), "query before")

    def call(step: int, mask: list[int] | None) -> None:
        # The reference: CPU copies over the Gloo group `side` (see _step).
        x, idx, w = _inputs(rank, step, world, torch.device("cpu"))
        idxd = idx.to(device)
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(
            x.to(device), idxd, MAX_TOKENS, 4 * world, use_fp8=False)  # fmt: skip
        want = ref.low_latency_dispatch(x, idx, MAX_TOKENS, 4 * world, use_fp8=False,
                                        group=side, mask=mask)  # fmt: skip
        m.bitwise(count, want.recv_count, f"recv_count step {step}")
        y = _expert(want.recv_x)
        combined, _, _ = buffer.low_latency_combine(y.to(device), idxd, w.to(device), handle)
        expected = ref.low_latency_combine(y, idx, w, want.handle, group=side, mask=mask)
        if device.type == "cpu":
            m.bitwise(combined, expected, f"combine step {step}")
        else:
            from moe_helpers import ll_combine_beyond_tolerance

            magnitude = ref.low_latency_combine(y.abs(), idx, w.abs(), want.handle, group=side,
                                                mask=mask)  # fmt: skip
            bad = ll_combine_beyond_tolerance(combined, expected, magnitude, TOPK)
            m.check(bad == 0, f"combine step {step}: {bad} outputs beyond tolerance")

    call(4, None)  # every rank, nothing masked (auto-masking on)
    if rank != world - 1:
        buffer.low_latency_update_mask_buffer(world - 1, True)
        buffer.low_latency_query_mask_buffer(status)
        m.bitwise(status, torch.tensor([0] * (world - 1) + [1], dtype=torch.int32), "query")
        call(5, [world - 1])
        buffer.low_latency_clean_mask_buffer()
        buffer.low_latency_query_mask_buffer(status)
        m.bitwise(status, torch.zeros(world, dtype=torch.int32), "query after clean")
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=side)
    return m.items


def test_deep_ep_mask_buffer_methods() -> None:
    for items in run_distributed(_deep_ep_worker, 3, backend="ep", timeout=120):
        assert items == [], items


@pytest.mark.gpu(min_gpus=2)
def test_deep_ep_mask_buffer_methods_cuda() -> None:
    """The same on the NVSHMEM kernels: enable_shrink's first call builds the buffers."""
    from _dist_utils import gpu_world_size

    res = run_distributed(_deep_ep_worker, gpu_world_size(), "cuda", backend="ep", timeout=240)
    for items in res:
        assert items == [], items


def _shrink_lifetime_worker(rank: int, world: int) -> dict[str, Any]:
    """A shrink Buffer, a refused non-shrink one beside it, then destroy(): masks cleaned and
    auto-masking off, so a peer that misses a call fails it instead of being masked."""
    import ep_backend as ep
    from ep_backend import deep_ep

    single_thread()
    side = dist.new_group(backend="gloo")
    group = dist.new_group(backend="ep", timeout=datetime.timedelta(seconds=3))
    out: dict[str, Any] = {}
    shrink = deep_ep.Buffer(group, low_latency_mode=True, enable_shrink=True,
                            explicitly_destroy=True)  # fmt: skip
    try:
        deep_ep.Buffer(group, low_latency_mode=True, explicitly_destroy=True)
        out["mixed"] = "no error"
    except ValueError as exc:
        out["mixed"] = str(exc)
    if rank == 0:
        shrink.low_latency_update_mask_buffer(world - 1, True)
    out["query_before"] = ep.low_latency_query_mask(group)
    shrink.destroy()
    out["query_after"] = ep.low_latency_query_mask(group)
    plain = deep_ep.Buffer(group, low_latency_mode=True, explicitly_destroy=True)
    if rank == 0:  # the last rank makes no call
        x, idx, _ = _inputs(rank, 0, world, torch.device("cpu"))
        start = time.monotonic()
        try:
            plain.low_latency_dispatch(x, idx, MAX_TOKENS, 4 * world, use_fp8=False)
            out["missed"] = "no error"
        except RuntimeError as exc:
            out["missed"] = str(exc)
        out["missed_seconds"] = time.monotonic() - start
    dist.barrier(group=side)
    return out


def test_shrink_buffers_share_masking_with_no_other_buffer_and_turn_it_off_when_destroyed() -> None:
    res = run_distributed(_shrink_lifetime_worker, 2, backend="ep", timeout=120)
    for rank, r in enumerate(res):
        assert "must agree on enable_shrink" in r["mixed"], (rank, r)
        assert r["query_before"] == ([1] if rank == 0 else []), (rank, r)
        assert r["query_after"] == [], (rank, r)
    assert res[0]["missed"] != "no error" and "1" in res[0]["missed"], res[0]
    assert res[0]["missed_seconds"] < 30, res[0]


def _divergent_deadline_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 2 joins a low-latency call after rank 0's auto-mask deadline but before rank 1's
    (rank 1 started later): every live rank must mask it alike, and rank 2 must learn it."""
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    side = dist.new_group(backend="gloo")
    group = dist.new_group(backend="ep", timeout=datetime.timedelta(seconds=30))
    ep.low_latency_auto_mask(AUTO_MASK_S_DIVERGENT, group=group)
    out: dict[str, Any] = {"mismatches": [], "error": None}
    m = Mismatches(context=f"rank {rank}")
    _step(ep, ref, group, side, rank, world, 0, torch.device("cpu"), None, m)  # all together
    dist.barrier(group=side)
    time.sleep({0: 0.0, 1: 1.2, 2: 2.5}[rank] * AUTO_MASK_S_DIVERGENT / 2.0)
    x, idx, _ = _inputs(rank, 1, world, torch.device("cpu"))
    try:
        got = ep.low_latency_dispatch(x, idx, MAX_TOKENS, 4 * world, use_fp8=False, group=group)
        want = ref.low_latency_dispatch(x, idx, MAX_TOKENS, 4 * world, use_fp8=False,
                                        group=side, mask=[2])  # fmt: skip
        compare_ll_dispatch(m, got, want)
    except RuntimeError as exc:
        out["error"] = str(exc)
        out["error_type"] = type(exc).__name__
        out["error_ranks"] = getattr(exc, "ranks", None)
    out["query"] = ep.low_latency_query_mask(group)
    dist.barrier(group=side)
    out["mismatches"] = m.items
    return out


AUTO_MASK_S_DIVERGENT = 2.0


def test_ranks_whose_auto_mask_deadlines_differ_mask_the_same_late_rank() -> None:
    res = run_distributed(_divergent_deadline_worker, 3, backend="ep", timeout=120)
    for rank in (0, 1):
        assert res[rank]["error"] is None, (rank, res[rank])
        assert res[rank]["mismatches"] == [], (rank, res[rank])
        assert res[rank]["query"] == [2], (rank, res[rank])
    assert "was masked by rank(s) 0" in (res[2]["error"] or ""), res[2]
    # A timeout-class failure: the type and the ranks named as for a peer that never joined.
    assert res[2]["error_type"] == "MoETimeoutError", res[2]
    assert tuple(res[2]["error_ranks"]) == (0,), res[2]
