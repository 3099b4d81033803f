"""Helpers shared by the MoE tests of ``ep_backend`` (``tests/test_moe_*.py``).

Comparisons collect mismatches as strings instead of raising, so that a worker keeps issuing the
same collectives as its peers after a mismatch (raising on one rank would leave the others
waiting) and the parent reports every mismatch of every rank at once.

Inputs are generated from seeds: ``make_generator(seed, rank)`` gives each rank its own tokens,
and parameters every rank must agree on (H, K, E, flags) come from a generator without the rank.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
T = TypeVar("T")


def kernel_grids(
    fn: Callable[[], T], keys: Sequence[str], match: Callable[[str], bool] = lambda _: True
) -> tuple[T, dict[str, set[int]]]:
    """Runs ``fn`` (then synchronises) under the CUDA profiler. Returns what it returned and the
    grid x of every kernel launch whose name contains one of ``keys`` and satisfies ``match``,
    keyed by that key."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    fd, trace = tempfile.mkstemp(suffix=".json", prefix="ep_kernel_grids_")
    os.close(fd)
    try:
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(trace)
    grids: dict[str, set[int]] = {}
    for ev in events:
        name = ev.get("name", "")
        if ev.get("cat") != "kernel" or not match(name):
            continue
        for key in keys:
            if key in name:
                grids.setdefault(key, set()).add(int(ev["args"]["grid"][0]))
    return result, grids


def single_thread() -> None:
    """Call first in a worker: ranks sharing a small machine must not oversubscribe its cores.

    With several intra-op threads per rank, every tiny parallel ATen op (``repeat_interleave``
    has grain size 1) wakes a thread pool that competes with the other ranks' processes, which
    makes each call ~5x slower on a 2-core machine.
    """
    torch.set_num_threads(1)


def cuda_routing(
    num_tokens: int, hidden: int, num_experts: int, topk: int, seed: int, distinct: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs of one rank on its current GPU: ``x`` BF16 ``[T, H]``, ``topk_idx`` int64
    ``[T, K]``, ``topk_weights`` float32 ``[T, K]``.

    ``distinct``: K different experts per token, 10% of the slots -1 (a router's top-k); else any
    ids in ``[-1, E)``, repeats included.
    """
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=dev, generator=g).bfloat16()
    if distinct:
        idx = torch.rand(num_tokens, num_experts, device=dev, generator=g).topk(topk).indices
        idx[torch.rand(num_tokens, topk, device=dev, generator=g) < 0.1] = -1
    else:
        idx = torch.randint(-1, num_experts, (num_tokens, topk), device=dev, generator=g)
    w = torch.rand(num_tokens, topk, device=dev, generator=g)
    return x, idx, w


def make_generator(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1_000_003 + k + 7
    return torch.Generator().manual_seed(seed % (2**62))


@dataclass
class Mismatches:
    """Collects the differences found on one rank; ``items`` travels back to the parent."""

    context: str = ""
    items: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.items.append(f"{self.context}: {what}" if self.context else what)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.fail(what)

    def bitwise(self, actual, expected, what: str) -> None:
        """Same presence, dtype, shape and bytes (float8 and NaN included)."""
        if actual is None or expected is None:
            if (actual is None) != (expected is None):
                self.fail(f"{what}: {'got None' if actual is None else 'expected None'}")
            return
        if not isinstance(actual, torch.Tensor):
            self.check(actual == expected, f"{what}: {actual!r} != {expected!r}")
            return
        if actual.dtype != expected.dtype:
            self.fail(f"{what}: dtype {actual.dtype} != {expected.dtype}")
            return
        if tuple(actual.shape) != tuple(expected.shape):
            self.fail(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
            return
        if not bytes_equal(actual, expected):
            self.fail(f"{what}: values differ")


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a8 = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b8 = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a8, b8)


# --------------------------------------------------------------------------------------------
# Random inputs
# --------------------------------------------------------------------------------------------


def random_topk(
    gen: torch.Generator,
    num_tokens: int,
    num_topk: int,
    num_experts: int,
    drop: float = 0.2,
    dtype: torch.dtype = torch.int64,
    unique: bool = True,
) -> torch.Tensor:
    """``[T, K]`` expert ids with about ``drop`` of the slots -1 (and some all -1 rows).

    With ``unique`` (and ``K <= E``) a token never lists an expert twice, as a real router;
    without it ids repeat freely (the contract allows it).
    """
    if unique and num_topk <= num_experts:
        scores = torch.rand((num_tokens, num_experts), generator=gen)
        idx = scores.topk(num_topk, dim=1).indices if num_tokens else scores[:, :num_topk].long()
    else:
        idx = torch.randint(0, num_experts, (num_tokens, num_topk), generator=gen)
    idx = idx.long()
    mask = torch.rand((num_tokens, num_topk), generator=gen) < drop
    idx = torch.where(mask, -1, idx)
    if num_tokens >= 3:  # one token with no expert at all
        idx[num_tokens // 2] = -1
    return idx.to(dtype)


def random_x(gen: torch.Generator, num_tokens: int, hidden: int, dtype: torch.dtype):
    """``(x, x_scales)``: FP8 values with float32 scales ``[T, ceil(H/128)]`` for FP8, else x."""
    if dtype == FP8:
        x = (torch.randn((num_tokens, hidden), generator=gen) * 50).clamp(-448, 448).to(FP8)
        scales = torch.rand((num_tokens, (hidden + 127) // 128), generator=gen) + 0.01
        return x, scales
    return (torch.randn((num_tokens, hidden), generator=gen) * 3).to(dtype), None


# --------------------------------------------------------------------------------------------
# Comparisons of whole results
# --------------------------------------------------------------------------------------------


def valid_rows(handle) -> int:
    return int(handle.num_recv_tokens_per_rank.sum())


def compare_handle(m: Mismatches, a, b) -> None:
    for name in ("num_ranks", "num_experts", "num_worst_tokens"):
        m.check(getattr(a, name) == getattr(b, name), f"handle.{name}")
    for name in (
        "is_token_in_rank",
        "num_tokens_per_rank",
        "num_recv_tokens_per_rank",
        "recv_src_idx",
        "recv_src_rank",
    ):
        m.bitwise(getattr(a, name), getattr(b, name), f"handle.{name}")


def compare_dispatch(m: Mismatches, a, b, cached: bool = False) -> None:
    """Compares two ``DispatchOutput``s (``recv_x``/scales: valid rows only, per the contract)."""
    n = valid_rows(b.handle)
    rows = b.recv_x.shape[0]
    m.check(a.recv_x.shape[0] == rows, f"recv_x rows {a.recv_x.shape[0]} != {rows}")
    m.bitwise(a.recv_x[:n], b.recv_x[:n], "recv_x")
    if b.recv_x_scales is None or a.recv_x_scales is None:
        m.bitwise(a.recv_x_scales, b.recv_x_scales, "recv_x_scales")
    else:
        m.check(a.recv_x_scales.shape[0] == rows, "recv_x_scales rows")
        m.bitwise(a.recv_x_scales[:n], b.recv_x_scales[:n], "recv_x_scales")
    m.bitwise(a.recv_topk_idx, b.recv_topk_idx, "recv_topk_idx")
    m.bitwise(a.recv_topk_weights, b.recv_topk_weights, "recv_topk_weights")
    m.bitwise(a.num_recv_tokens_per_expert, b.num_recv_tokens_per_expert, "per_expert")
    m.check(
        a.num_recv_tokens_per_expert_list == b.num_recv_tokens_per_expert_list,
        f"per_expert_list {a.num_recv_tokens_per_expert_list} != "
        f"{b.num_recv_tokens_per_expert_list}",
    )
    if cached:
        m.check(a.handle is not None, "cached dispatch returns the handle")
    else:
        compare_handle(m, a.handle, b.handle)


def compare_combine(m: Mismatches, a, b) -> None:
    m.bitwise(a.combined_x, b.combined_x, "combined_x")
    m.bitwise(a.combined_topk_weights, b.combined_topk_weights, "combined_topk_weights")


def ll_combine_beyond_tolerance(
    got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, topk: int
) -> int:
    """Outputs of a low-latency combine beyond float32-accumulation tolerance of the reference.

    The NVSHMEM kernel adds the same float32 products ``w_k * y_k`` in another order (per expert
    rank, then the ranks) than the reference (``k`` ascending). ``want`` is the reference's BF16
    ``[T, H]``; ``magnitude`` the reference combine of ``|y|`` with ``|w|`` (the scale of any
    reordering error). Allowed: one BF16 ulp of the larger magnitude plus ``2 K 2^-23 sum|w y|``.
    """
    g, w, mag = got.float().cpu(), want.float().cpu(), magnitude.float().cpu()
    larger = torch.maximum(g.abs(), w.abs())
    _, exponent = torch.frexp(larger)
    ulp = torch.where(larger > 0, torch.ldexp(torch.ones_like(larger), exponent - 8), 0.0)
    tolerance = ulp + 2 * topk * mag * 2.0**-23
    return int(((g - w).abs() > tolerance).sum())


def ll_valid_mask(recv_count: torch.Tensor, slots: int) -> torch.Tensor:
    """bool ``[E_loc, slots]``: the slots below each expert's ``recv_count``."""
    slot = torch.arange(slots, device=recv_count.device)
    return slot.unsqueeze(0) < recv_count.long().unsqueeze(1)


def compare_ll_dispatch(m: Mismatches, a, b) -> None:
    """Compares two ``LowLatencyDispatchOutput``s (``recv_x``/scales: valid slots only)."""
    m.bitwise(a.recv_count, b.recv_count, "recv_count")
    m.bitwise(a.handle.src_info, b.handle.src_info, "src_info")
    m.bitwise(a.handle.layout_range, b.handle.layout_range, "layout_range")
    for name in ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "num_ranks"):
        m.check(getattr(a.handle, name) == getattr(b.handle, name), f"handle.{name}")
    if a.recv_x.shape != b.recv_x.shape or a.recv_x.dtype != b.recv_x.dtype:
        m.fail(f"recv_x {a.recv_x.dtype} {tuple(a.recv_x.shape)} vs {b.recv_x.dtype} "
               f"{tuple(b.recv_x.shape)}")  # fmt: skip
        return
    mask = ll_valid_mask(b.recv_count, b.recv_x.shape[1])
    a_mask = mask.to(a.recv_x.device)  # the two may be on different devices (CUDA vs reference)
    m.bitwise(a.recv_x[a_mask], b.recv_x[mask], "recv_x (valid slots)")
    if a.recv_x_scales is None or b.recv_x_scales is None:
        m.bitwise(a.recv_x_scales, b.recv_x_scales, "recv_x_scales")
    else:
        m.check(a.recv_x_scales.is_contiguous(), "recv_x_scales must be contiguous")
        m.bitwise(a.recv_x_scales.shape, b.recv_x_scales.shape, "recv_x_scales shape")
        if a.recv_x_scales.shape == b.recv_x_scales.shape:
            m.bitwise(a.recv_x_scales[a_mask], b.recv_x_scales[mask], "recv_x_scales")


def scale_rows(y: torch.Tensor, factor: float) -> torch.Tensor:
    """A cheap, exactly reproducible "expert": ``y * factor`` computed in float32."""
    if y.dtype == FP8:
        return y.float().mul(factor)
    return y.float().mul(factor).to(y.dtype)


def all_ranks_sizes(seed: int, world: int, low: int, high: int, zero_rank: int | None = None):
    """Per-rank token counts every rank can compute (uneven; ``zero_rank`` gets 0 tokens)."""
    gen = make_generator(seed, 999)
    sizes = torch.randint(low, high + 1, (world,), generator=gen).tolist()
    if zero_rank is not None and zero_rank < world:
        sizes[zero_rank] = 0
    return sizes


def format_failures(results: Sequence[list[str]]) -> str:
    lines = []
    for rank, items in enumerate(results):
        lines += [f"rank {rank}: {item}" for item in items]
    return "\n".join(lines[:60]) + (f"\n... {len(lines) - 60} more" if len(lines) > 60 else "")


def nvshmem_built() -> bool:
    """The build made libep_nvshmem.so: the low-latency ops must then run on its kernels."""
    from pathlib import Path

    import ep_backend

    return (Path(ep_backend.__file__).parent / "libep_nvshmem.so").exists()
