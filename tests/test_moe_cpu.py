"""The MoE collectives of ``ep_backend`` on CPU ranks, compared bit for bit with the reference.

Every case runs the same call through ``ep_backend`` (the C++ ops behind ``torch.ops.ep``) and
through ``ep_backend.reference`` (the executable spec, plain ``all_to_all_single``) on the same
``"ep"`` group, and compares dtypes, shapes and bytes. Many configurations share one worker run
per world size (starting processes costs seconds); each rank collects its mismatches and the
parent reports them all. Received padding (``num_worst_tokens``) and low-latency slots past
``recv_count`` are unspecified by the contract and are compared only where valid; the padding
rows given to combine hold NaN, which must be ignored.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed
from moe_helpers import (
    BF16,
    FP8,
    Mismatches,
    all_ranks_sizes,
    bytes_equal,
    compare_combine,
    compare_dispatch,
    compare_ll_dispatch,
    format_failures,
    make_generator,
    random_topk,
    random_x,
    scale_rows,
    single_thread,
)

TIMEOUT = 120.0

# --------------------------------------------------------------------------------------------
# High-throughput dispatch / combine: one configuration
# --------------------------------------------------------------------------------------------

# Defaults of a high-throughput configuration; each entry of HT_CONFIGS overrides some.
HT_DEFAULTS: dict[str, Any] = {
    "dtype": BF16,
    "hidden": 200,  # BF16: 400-byte rows, not a multiple of 128 elements
    "topk": 4,
    "experts_per_rank": 3,
    "idx_dtype": torch.int64,
    "unique": True,
    "weights": True,
    "scales": "f32",  # FP8 only: "f32" [T, ceil(H/128)], "i32" packed words, "strided"
    "alignment": 1,
    "worst": "none",  # "none" (exact sizes), "exact" (= the largest receive), "slack" (+5)
    "tokens": (0, 9),  # per-rank T drawn from this range
    "zero_rank": 1,  # this rank has T = 0 (None: none)
    "bias": "none",  # "none", "one", "two", "mixed" (a float32 bias and a BF16 one), "none_in"
    "cached": True,  # re-send other rows along the handle (another dtype and H)
    "async": False,
    "methods": False,  # call the methods of the backend object instead of the functions
    "layout": False,  # pass get_dispatch_layout's result to dispatch (layout=)
}

HT_CONFIGS: list[dict[str, Any]] = [
    {},
    {"dtype": torch.float32, "hidden": 36, "bias": "one", "idx_dtype": torch.int32},
    {"dtype": torch.float32, "hidden": 36, "weights": False, "bias": "two", "zero_rank": 0},
    {"dtype": torch.float64, "hidden": 6, "bias": "two", "topk": 1},
    {"dtype": torch.float16, "hidden": 24, "bias": "mixed", "alignment": 4},
    {"dtype": FP8, "hidden": 256, "scales": "f32", "alignment": 128},
    {"dtype": FP8, "hidden": 512, "scales": "i32", "idx_dtype": torch.int32, "worst": "exact"},
    {"dtype": FP8, "hidden": 48, "scales": "strided", "worst": "slack", "weights": False},
    {"topk": 1, "experts_per_rank": 1, "alignment": 4},
    {"topk": 8, "experts_per_rank": 4, "worst": "exact", "bias": "one"},
    {"topk": 8, "experts_per_rank": 2, "unique": False, "alignment": 128, "weights": False},
    {"topk": 32, "experts_per_rank": 16, "worst": "slack", "tokens": (1, 6)},
    {"topk": 32, "experts_per_rank": 3, "unique": False, "idx_dtype": torch.int32},
    {"worst": "exact", "bias": "two", "zero_rank": None, "tokens": (3, 12)},
    {"worst": "slack", "weights": False, "bias": "none_in"},
    {"tokens": (0, 0), "zero_rank": None, "bias": "one"},  # no tokens anywhere
    {"tokens": (0, 0), "zero_rank": None, "worst": "slack"},
    {"async": True, "bias": "one"},
    {"async": True, "worst": "exact", "dtype": FP8, "hidden": 128},
    {"methods": True, "bias": "two"},
    {"methods": True, "worst": "slack", "dtype": torch.float32, "hidden": 36},
    {"layout": True, "bias": "one"},
    {"layout": True, "worst": "exact", "dtype": FP8, "hidden": 256, "alignment": 4},
    {"layout": True, "topk": 8, "unique": False, "idx_dtype": torch.int32, "async": True},
    {"layout": True, "methods": True, "worst": "slack", "tokens": (0, 0), "zero_rank": None},
]


def _make_bias(gen, cfg, num_tokens: int, hidden: int, dtype: torch.dtype):
    def one(d: torch.dtype) -> torch.Tensor:
        return torch.randn((num_tokens, hidden), generator=gen).to(d)

    kind = cfg["bias"]
    if kind == "none":
        return None
    if kind == "one":
        return one(dtype)
    if kind == "two":
        return (one(dtype), one(dtype))
    if kind == "mixed":
        return (one(torch.float32), one(BF16))
    if kind == "none_in":  # a tuple holding None entries counts as no bias
        return (None, one(dtype))
    raise ValueError(kind)


def run_ht_config(ep, ref, rank: int, world: int, seed: int, cfg: dict, m: Mismatches) -> None:
    """One high-throughput configuration: dispatch, combine, cached dispatch, vs the reference."""
    cfg = {**HT_DEFAULTS, **cfg}
    group = dist.group.WORLD
    gen = make_generator(seed, rank)
    num_experts = cfg["experts_per_rank"] * world
    sizes = all_ranks_sizes(seed, world, *cfg["tokens"], zero_rank=cfg["zero_rank"])
    num_tokens, hidden, dtype = sizes[rank], cfg["hidden"], cfg["dtype"]
    x, scales = random_x(gen, num_tokens, hidden, dtype)
    if scales is not None and cfg["scales"] == "i32":
        scales = torch.randint(-(2**31), 2**31 - 1, (num_tokens, hidden // 512), generator=gen)
        scales = scales.to(torch.int32)
    elif scales is not None and cfg["scales"] == "strided":  # column-major [T, S]
        scales = scales.t().contiguous().t()
    idx = random_topk(
        gen, num_tokens, cfg["topk"], num_experts, dtype=cfg["idx_dtype"], unique=cfg["unique"]
    )
    weights = torch.rand((num_tokens, cfg["topk"]), generator=gen) if cfg["weights"] else None
    kwargs = {"x_scales": scales, "expert_alignment": cfg["alignment"]}

    worst = 0
    if cfg["worst"] != "none":  # the largest receive over all ranks, from an exact dispatch
        probe = ref.dispatch(x, idx, None, num_experts, group=group)
        largest = torch.tensor([probe.handle.num_recv_rows])
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        worst = int(largest) + (5 if cfg["worst"] == "slack" else 0)
        worst = max(worst, 1)
    kwargs["num_worst_tokens"] = worst

    api = ep.get_backend() if cfg["methods"] else ep
    is_async = cfg["async"]
    extra = {"async_op": True} if is_async else {}
    given = {"layout": api.get_dispatch_layout(idx, num_experts, **extra)} if cfg["layout"] else {}
    if is_async and given:  # the layout with async_op too (DeepEP's async_finish)
        m.check(given["layout"].work is not None, "async get_dispatch_layout returns a Work")
        given["layout"].work.wait()
    a = api.all_to_all_moe_dispatch(x, idx, weights, num_experts, **kwargs, **extra, **given)
    if is_async:
        m.check(a.work is not None, "async dispatch returns a Work")
        a.work.wait()
    else:
        m.check(a.work is None, "sync dispatch has no Work")
    b = ref.dispatch(x, idx, weights, num_experts, **kwargs)
    # The per-expert list is there in async mode too: the host has the counts before it launches.
    compare_dispatch(m, a, b)

    # Expert outputs; the padding rows hold NaN, which combine must ignore.
    n_valid = int(b.handle.num_recv_tokens_per_rank.sum())
    y = scale_rows(b.recv_x, 1.5)
    if y.dtype == BF16 and hidden % 2 == 0:
        y = y.float()[:, : hidden // 2].to(BF16)  # combine may change H (row bytes stay aligned)
    y_w = b.recv_topk_weights
    if worst > 0:
        y = y.clone()
        y[n_valid:] = float("nan")
        if y_w is not None:
            y_w = y_w.clone()
            y_w[n_valid:] = float("nan")
    bias = _make_bias(gen, cfg, num_tokens, y.shape[1], y.dtype)
    c = api.combine(y, a.handle, y_w, bias, **extra)
    if is_async:
        m.check(c.work is not None, "async combine returns a Work")
        c.work.wait()
    d = ref.combine(y, b.handle, y_w, bias)
    compare_combine(m, c, d)
    if y_w is not None and d.combined_topk_weights is not None:
        # Combining the received weights gives back the original ones where idx >= 0.
        expected_w = torch.where(idx >= 0, weights, 0.0)
        m.check(bytes_equal(c.combined_topk_weights, expected_w), "combined weights round trip")

    if cfg["cached"]:
        x2 = torch.randn((num_tokens, 20), generator=gen)  # another dtype and H
        a2 = api.all_to_all_moe_dispatch(x2, handle=a.handle, **extra)
        if is_async:
            a2.work.wait()
        b2 = ref.dispatch(x2, handle=b.handle)
        compare_dispatch(m, a2, b2, cached=True)
        if scales is not None:  # FP8 with its scales, through the tuple form
            a3 = ep.dispatch((x, scales), handle=a.handle)
            b3 = ref.dispatch(x, x_scales=scales, handle=b.handle)
            compare_dispatch(m, a3, b3, cached=True)


# --------------------------------------------------------------------------------------------
# Low-latency dispatch / combine: one configuration
# --------------------------------------------------------------------------------------------

LL_DEFAULTS: dict[str, Any] = {
    "hidden": 256,
    "topk": 4,
    "experts_per_rank": 3,
    "max_tokens": 8,
    "idx_dtype": torch.int64,
    "fp8": True,
    "round_scale": False,
    "ue8m0": False,
    "zero_rank": 1,
    "stats": False,
    "hook": False,
    "out": False,
    "async": False,
    "methods": False,
}

LL_CONFIGS: list[dict[str, Any]] = [
    {"fp8": False},
    {},
    {"round_scale": True, "idx_dtype": torch.int32},
    {"round_scale": True, "ue8m0": True, "hidden": 512, "stats": True},
    {"fp8": False, "hidden": 128, "topk": 1, "experts_per_rank": 1, "out": True},
    {"topk": 8, "experts_per_rank": 4, "hook": True, "zero_rank": None},
    {"max_tokens": 3, "stats": True, "out": True, "async": True},
    {"fp8": False, "methods": True, "stats": True, "out": True},
    # E > 2R + 8: the per-expert counts take the agreement's second all-gather
    {"experts_per_rank": 8, "topk": 8, "round_scale": True, "stats": True},
]


def run_ll_config(ep, ref, rank: int, world: int, seed: int, cfg: dict, m: Mismatches) -> None:
    """One low-latency configuration: dispatch then combine, vs the reference."""
    cfg = {**LL_DEFAULTS, **cfg}
    gen = make_generator(seed, rank)
    max_tokens, hidden = cfg["max_tokens"], cfg["hidden"]
    experts_per_rank = cfg["experts_per_rank"]
    num_experts = experts_per_rank * world
    sizes = all_ranks_sizes(seed, world, 0, max_tokens, zero_rank=cfg["zero_rank"])
    num_tokens = sizes[rank]
    x = (torch.randn((num_tokens, hidden), generator=gen) * 4).to(BF16)
    idx = random_topk(gen, num_tokens, cfg["topk"], num_experts, dtype=cfg["idx_dtype"])
    weights = torch.rand((num_tokens, cfg["topk"]), generator=gen)
    weights = torch.where(idx >= 0, weights, float("nan"))  # never read where idx == -1
    flags = {"use_fp8": cfg["fp8"], "round_scale": cfg["round_scale"], "use_ue8m0": cfg["ue8m0"]}

    api = ep.get_backend() if cfg["methods"] else ep
    stats_a = stats_b = None
    if cfg["stats"]:
        start = torch.randint(0, 100, (experts_per_rank,), generator=gen, dtype=torch.int32)
        stats_a, stats_b = start.clone(), start.clone()
    extra: dict[str, Any] = {}
    if cfg["hook"]:
        extra["return_recv_hook"] = True
    if cfg["async"]:
        extra["async_op"] = True
    a = api.low_latency_dispatch(
        x, idx, max_tokens, num_experts, cumulative_local_expert_recv_stats=stats_a,
        **flags, **extra,
    )  # fmt: skip
    if cfg["hook"]:
        m.check(callable(a.hook), "return_recv_hook gives a hook")
        a.hook()
    else:
        m.check(a.hook is None, "no hook without return_recv_hook")
    if cfg["async"]:
        m.check(a.work is not None, "async low_latency_dispatch returns a Work")
        a.work.wait()
    b = ref.low_latency_dispatch(
        x, idx, max_tokens, num_experts, cumulative_local_expert_recv_stats=stats_b, **flags
    )
    compare_ll_dispatch(m, a, b)
    if stats_a is not None:
        m.bitwise(stats_a, stats_b, "cumulative_local_expert_recv_stats")

    # Expert outputs (BF16); the slots past recv_count hold NaN, which must not be read.
    y = torch.randn(b.recv_x.shape, generator=gen).to(BF16)
    y[torch.arange(y.shape[1]).unsqueeze(0) >= b.recv_count.long().unsqueeze(1)] = float("nan")
    out = torch.full((num_tokens, hidden), 7.0, dtype=BF16) if cfg["out"] else None
    combine_extra = {"async_op": True} if cfg["async"] else {}
    got = api.low_latency_combine(y, idx, weights, a.handle, out=out, **combine_extra)
    if cfg["async"]:
        got.work.wait()
    if out is not None:
        m.check(got is out, "low_latency_combine returns out")
    expected = ref.low_latency_combine(y, idx, weights, b.handle)
    m.bitwise(got, expected, "low_latency_combine")


# --------------------------------------------------------------------------------------------
# Workers and tests
# --------------------------------------------------------------------------------------------


def _matrix_worker(rank: int, world: int, kind: str, configs: list[dict]) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    run = run_ht_config if kind == "ht" else run_ll_config
    m = Mismatches()
    for i, cfg in enumerate(configs):
        m.context = f"{kind} config {i} {cfg}"
        run(ep, ref, rank, world, 100 + i, cfg, m)
    return m.items


@pytest.mark.parametrize("world", [2, 4])
def test_high_throughput_matches_reference(world: int) -> None:
    results = run_distributed(
        _matrix_worker, world, "ht", HT_CONFIGS, backend="ep", timeout=TIMEOUT
    )
    assert not any(results), format_failures(results)


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_matches_reference(world: int) -> None:
    results = run_distributed(
        _matrix_worker, world, "ll", LL_CONFIGS, backend="ep", timeout=TIMEOUT
    )
    assert not any(results), format_failures(results)


def _worst_overflow_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    m = Mismatches(context="num_worst_tokens overflow")
    gen = make_generator(7, rank)
    num_experts = 2 * world
    x = torch.randn((6, 64), generator=gen).to(BF16)
    idx = random_topk(gen, 6, 2, num_experts, drop=0.0)
    idx[:, 0] = 0  # every token of every rank goes to rank 0: it receives 6 * world rows
    for worst in (1, 6 * world - 1):
        try:
            ep.dispatch(x, idx, None, num_experts, num_worst_tokens=worst)
            m.fail(f"num_worst_tokens={worst}: no error")
        except RuntimeError as exc:
            m.check("num_worst_tokens" in str(exc), f"message: {exc}")
    # The group is still usable, and the next call is exact (also at exactly the capacity).
    for worst in (0, 6 * world):
        a = ep.dispatch(x, idx, None, num_experts, num_worst_tokens=worst)
        b = ref.dispatch(x, idx, None, num_experts, num_worst_tokens=worst)
        compare_dispatch(m, a, b)
        y = scale_rows(b.recv_x, 2.0)
        compare_combine(m, ep.combine(y, a.handle), ref.combine(y, b.handle))
    return m.items


def test_num_worst_tokens_too_small_raises_everywhere() -> None:
    results = run_distributed(_worst_overflow_worker, 2, backend="ep", timeout=60)
    assert not any(results), format_failures(results)


def _subgroup_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    m = Mismatches()
    # Two disjoint subgroups (every rank creates both, in the same order), and a reversed one.
    halves = [list(range(0, world // 2)), list(range(world // 2, world))]
    groups = [dist.new_group(ranks) for ranks in halves]
    mine = groups[0] if rank < world // 2 else groups[1]
    reversed_group = dist.new_group(list(range(world))[::-1])
    for g_index, group in enumerate((mine, reversed_group)):
        m.context = f"subgroup {g_index}"
        size = dist.get_world_size(group)
        gen = make_generator(31 + g_index, rank)
        num_experts = 2 * size
        num_tokens = [3, 0, 5, 2][rank]
        x = torch.randn((num_tokens, 40), generator=gen).to(BF16)
        idx = random_topk(gen, num_tokens, 3, num_experts)
        weights = torch.rand((num_tokens, 3), generator=gen)
        backend = ep.get_backend(group)
        m.check(backend.size() == size, "backend size")
        a = backend.all_to_all_moe_dispatch(x, idx, weights, num_experts)
        b = ref.dispatch(x, idx, weights, num_experts, group=group)
        compare_dispatch(m, a, b)
        m.check(a.handle.num_ranks == size, "handle.num_ranks is the subgroup size")
        y = scale_rows(b.recv_x, 0.5)
        compare_combine(
            m,
            backend.combine(y, a.handle, b.recv_topk_weights),
            ref.combine(y, b.handle, b.recv_topk_weights, group=group),
        )
        c = ep.combine(y, a.handle, bias=x, group=group)
        compare_combine(m, c, ref.combine(y, b.handle, bias=x, group=group))
        layout = backend.get_dispatch_layout(idx, num_experts)
        ref_layout = ref.get_dispatch_layout(idx, num_experts, size)
        for got, want, name in zip(
            layout, ref_layout, ("per_rank", "per_expert", "in_rank"), strict=True
        ):
            m.bitwise(got, want, f"layout.{name}")
        xl = torch.randn((num_tokens, 128), generator=gen).to(BF16)
        la = backend.low_latency_dispatch(xl, idx, 6, num_experts)
        lb = ref.low_latency_dispatch(xl, idx, 6, num_experts, group=group)
        compare_ll_dispatch(m, la, lb)
        # CPU tensors never use the NVLink transport: reserve agrees, then reserves nothing.
        # (device="cpu": on a machine with GPUs the default device is the current GPU.)
        m.check(
            backend.reserve(num_tokens + 1, 40, 3, num_experts, device="cpu") is None,
            "reserve on CPU",
        )
        m.check(
            ep.reserve(8, 128, 3, num_experts, dtype=torch.float32, group=group, device="cpu")
            is None,
            "ep.reserve on CPU",
        )
        yl = torch.randn(lb.recv_x.shape, generator=gen).to(BF16)
        m.bitwise(
            backend.low_latency_combine(yl, idx, weights, la.handle),
            ref.low_latency_combine(yl, idx, weights, lb.handle, group=group),
            "low_latency_combine",
        )
    # A backend method takes its own group: passing another one is an error.
    try:
        ep.get_backend(mine).combine(y, a.handle, group=mine)
        m.fail("group= on a backend method: no error")
    except TypeError:
        pass
    return m.items


def test_subgroups_and_backend_methods() -> None:
    results = run_distributed(_subgroup_worker, 4, backend="ep", timeout=TIMEOUT)
    assert not any(results), format_failures(results)


def _group_check_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep

    single_thread()
    m = Mismatches(context="group check")
    gen = make_generator(5, rank)
    idx = random_topk(gen, 6, 2, 2 * world)
    x = torch.randn((6, 32), generator=gen).to(torch.bfloat16)
    # A group of another backend is refused on this rank, every time (only "ep" groups are
    # remembered as checked).
    gloo = dist.new_group(list(range(world)), backend="gloo")
    for attempt in range(2):
        try:
            ep.dispatch(x, idx, None, 2 * world, group=gloo)
            m.fail(f"dispatch on a gloo group (attempt {attempt}): no error")
        except ValueError as exc:
            m.check("backend 'ep', got 'gloo'" in str(exc), f"message: {exc}")
    # An "ep" group used, then destroyed: a later call raises (it does not run on a dead group).
    sub = dist.new_group(list(range(world)), backend="ep")
    got = ep.dispatch(x, idx, None, 2 * world, group=sub)
    m.bitwise(got.recv_x, ep.dispatch(x, idx, None, 2 * world).recv_x, "sub and WORLD agree")
    dist.destroy_process_group(sub)
    try:
        ep.dispatch(x, idx, None, 2 * world, group=sub)
        m.fail("dispatch on a destroyed group: no error")
    except RuntimeError as exc:  # from the op, on every rank before any exchange
        m.check("called on a process group that was shut down" in str(exc), f"message: {exc}")
    # The world group still works.
    again = ep.dispatch(x, idx, None, 2 * world)
    m.bitwise(again.recv_x, got.recv_x, "WORLD after the subgroup's destruction")
    return m.items


def test_collectives_refuse_other_backends_and_destroyed_groups() -> None:
    results = run_distributed(_group_check_worker, 2, backend="ep", timeout=60)
    assert not any(results), format_failures(results)


def _fallback_warning_worker(rank: int, world: int) -> list[str]:
    """The once-per-group fallback warning, against a stand-in for the backend's verdicts."""
    import warnings

    import ep_backend as ep
    from ep_backend import _fallback, _groups

    m = Mismatches(context="fallback warning")

    from ep_backend._C import TransportKind

    class Choice:  # as EPProcessGroup.*_transport_choice: ep_backend._C.TransportChoice
        def __init__(self, kind: str, reason: str = "", requested: bool = False) -> None:
            self.kind = getattr(TransportKind, kind)
            self.reason = reason
            self.requested = requested

    class Verdicts:
        high_throughput_transport_choice = Choice("undecided")
        low_latency_transport_choice = Choice("undecided")

    verdicts = Verdicts()
    real = _fallback.get_backend
    _fallback.get_backend = lambda group=None: verdicts
    try:

        def warned(kind: str, on_cuda: bool = True) -> list[str]:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                _fallback._check_fallback(*_groups._group_state(pg), kind, on_cuda)
            return [str(w.message) for w in seen if issubclass(w.category, ep.FallbackWarning)]

        def singleton() -> dist.ProcessGroup:  # every rank creates every group, as torch asks
            return _groups._group([dist.new_group([r], backend="ep") for r in range(world)][rank])

        pg = singleton()
        m.check(warned("high_throughput") == [], "undecided: no warning yet")
        verdicts.high_throughput_transport_choice = Choice("aten", "the reason")
        m.check(warned("high_throughput", on_cuda=False) == [], "CPU tensors: never")
        first = warned("high_throughput")
        m.check(len(first) == 1 and "the reason" in first[0], f"one warning with why: {first}")
        m.check("high-throughput MoE ops" in first[0], f"names the ops: {first}")
        m.check(warned("high_throughput") == [], "said once per group")
        verdicts.low_latency_transport_choice = Choice("nvshmem")
        m.check(warned("low_latency") == [], "the kernels: no warning")
        pg = singleton()
        verdicts.low_latency_transport_choice = Choice("aten", "EP_LOW_LATENCY=aten", True)
        m.check(warned("low_latency") == [], "asked for: no warning")
        verdicts.high_throughput_transport_choice = Choice("aten", "built without CUDA")
        again = warned("high_throughput")
        m.check(len(again) == 1 and "built without CUDA" in again[0], f"another group: {again}")
    finally:
        _fallback.get_backend = real
    return m.items


def test_fallback_to_aten_warns_once_per_group_unless_asked_for() -> None:
    results = run_distributed(_fallback_warning_worker, 2, backend="ep", timeout=60)
    assert not any(results), format_failures(results)


def _layout_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    m = Mismatches(context="get_dispatch_layout")
    for i, (num_tokens, topk, per_rank, dtype) in enumerate(
        itertools.product((0, 1, 9), (1, 8), (1, 4), (torch.int64, torch.int32))
    ):
        gen = make_generator(i, rank)
        idx = random_topk(gen, num_tokens, topk, per_rank * world, dtype=dtype, unique=False)
        got = ep.get_dispatch_layout(idx, per_rank * world)
        want = ref.get_dispatch_layout(idx, per_rank * world, world)
        for g, w, name in zip(got, want, ("per_rank", "per_expert", "in_rank"), strict=True):
            m.bitwise(g, w, f"{name} (T={num_tokens} K={topk} E_loc={per_rank} {dtype})")
        m.bitwise(got.send_pos, want.send_pos, f"send_pos (T={num_tokens} K={topk} {dtype})")
        m.check(got.work is None, "a synchronous layout has no Work")
    # async_op: a Work (completed on CPU), the same values.
    gen = make_generator(77, rank)
    idx = random_topk(gen, 11, 4, 4 * world)
    got = ep.get_dispatch_layout(idx, 4 * world, async_op=True)
    m.check(got.work is not None and got.work.wait(), "async layout: a Work that completes")
    want = ref.get_dispatch_layout(idx, 4 * world, world)
    m.bitwise(got.send_pos, want.send_pos, "async layout: send_pos")
    m.bitwise(got.num_tokens_per_expert, want.num_tokens_per_expert, "async layout: per_expert")
    # Bad arguments raise on this rank (nothing is exchanged).
    for bad, exc_type, needle in (
        ({"previous_event": "e"}, TypeError, "previous_event must be a torch.cuda.Event"),
        ({"topk_idx": [[0]]}, TypeError, "topk_idx must be a tensor"),
    ):
        args = {"topk_idx": idx, "num_experts": 4 * world, **bad}
        try:
            ep.get_dispatch_layout(**args)
            m.check(False, f"get_dispatch_layout({bad}) did not raise")
        except exc_type as exc:
            m.check(f"ep get_dispatch_layout: {needle}" in str(exc), f"message: {exc}")
    # Inference tensors have no version counter: a layout of one still passes to dispatch.
    with torch.inference_mode():
        gen = make_generator(99, rank)
        idx = random_topk(gen, 7, 4, 2 * world)
        x = torch.randn((7, 32), generator=gen).to(torch.bfloat16)
        got = ep.dispatch(x, idx, None, 2 * world, layout=ep.get_dispatch_layout(idx, 2 * world))
        want = ref.dispatch(x, idx, None, 2 * world)
        m.bitwise(got.recv_x, want.recv_x, "inference mode, layout given: recv_x")
        m.bitwise(got.recv_topk_idx, want.recv_topk_idx, "inference mode: recv_topk_idx")
    return m.items


def test_get_dispatch_layout_matches_reference() -> None:
    results = run_distributed(_layout_worker, 2, backend="ep", timeout=60)
    assert not any(results), format_failures(results)


# --------------------------------------------------------------------------------------------
# Random-shape soak
# --------------------------------------------------------------------------------------------

SOAK_ITERATIONS = 1000


def random_config(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A random configuration (every rank draws the same one from the same seed)."""
    if rng.random() < 0.2:
        fp8 = rng.random() < 0.6
        ue8m0 = fp8 and rng.random() < 0.3
        experts_per_rank = rng.choice([1, 2, 3, 4, 8])
        return "ll", {
            "hidden": 512 if ue8m0 else rng.choice([128, 256, 384]),
            # K <= E: a token never repeats an expert, so no rank exceeds M rows per expert
            "topk": min(rng.choice([1, 2, 3, 4, 8]), 2 * experts_per_rank),
            "experts_per_rank": experts_per_rank,
            "max_tokens": rng.choice([1, 2, 5, 8]),
            "idx_dtype": rng.choice([torch.int64, torch.int32]),
            "fp8": fp8,
            "round_scale": ue8m0 or (fp8 and rng.random() < 0.5),
            "ue8m0": ue8m0,
            "zero_rank": rng.choice([None, 0, 1]),
            "stats": rng.random() < 0.3,
            "out": rng.random() < 0.3,
        }
    dtype, hidden = rng.choice(
        [
            (BF16, rng.choice([8, 24, 64, 200, 256])),
            (torch.float32, rng.choice([4, 12, 36, 128])),
            (torch.float64, rng.choice([2, 6, 18])),
            (torch.float16, rng.choice([8, 40])),
            (FP8, rng.choice([16, 48, 128, 512])),
        ]
    )
    topk = rng.choice([1, 2, 3, 4, 8, 16, 32])
    experts_per_rank = rng.choice([1, 2, 3, 5, 8, 16])
    return "ht", {
        "dtype": dtype,
        "hidden": hidden,
        "topk": topk,
        "experts_per_rank": experts_per_rank,
        "idx_dtype": rng.choice([torch.int64, torch.int32]),
        "unique": rng.random() < 0.7,
        "weights": rng.random() < 0.7,
        "scales": "i32" if dtype == FP8 and hidden == 512 else rng.choice(["f32", "strided"]),
        "alignment": rng.choice([1, 1, 2, 4, 128]),
        "worst": rng.choice(["none", "none", "exact", "slack"]),
        "tokens": rng.choice([(0, 3), (0, 10), (5, 20)]),
        "zero_rank": rng.choice([None, None, 0, 1]),
        "bias": rng.choice(["none", "one", "two", "mixed"]),
        "cached": rng.random() < 0.3,
        "async": rng.random() < 0.1,
        "methods": rng.random() < 0.1,
    }


def _soak_worker(rank: int, world: int, iterations: int, seed: int) -> tuple[int, list[str]]:
    import ep_backend as ep
    from ep_backend import reference as ref

    single_thread()
    rng = random.Random(seed)
    m = Mismatches()
    kinds = {"ht": 0, "ll": 0}
    for it in range(iterations):
        kind, cfg = random_config(rng)
        kinds[kind] += 1
        m.context = f"soak iteration {it} {kind} {cfg}"
        run = run_ht_config if kind == "ht" else run_ll_config
        run(ep, ref, rank, world, seed * 100_000 + it, cfg, m)
        if len(m.items) > 20:
            break
    return kinds["ll"], m.items


def test_random_soak() -> None:
    results = run_distributed(_soak_worker, 2, SOAK_ITERATIONS, 2024, backend="ep", timeout=TIMEOUT)
    failures = [items for _, items in results]
    assert not any(failures), format_failures(failures)
    assert results[0][0] > SOAK_ITERATIONS // 10, "the soak must cover low-latency calls too"


def test_record_stream_checks_its_arguments_and_knows_plain_tensors() -> None:
    """``ep_backend.record_stream`` rejects non-tensors and non-CUDA streams; a tensor that does
    not view a receive slab is not one (the CUDA case is in test_intranode_gpu.py)."""
    import ep_backend as ep

    with pytest.raises(TypeError, match="tensor must be a tensor, got list"):
        ep.record_stream([1.0], None)
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream, got int"):
        ep.record_stream(torch.zeros(2), 0)
    assert ep._C._record_slab_stream(torch.zeros(2), 0, 0, 1) is False
