"""Tests of the executable spec ``ep_backend/reference.py`` against dense single-process oracles.

Every worker regenerates *all* ranks' inputs from a shared seed, computes what it must receive
with plain loops over ranks and tokens (written independently of the reference), and compares
bitwise. The distributed tests run 1, 2 and 4 Gloo ranks on CPU via ``_dist_utils``.

The reference is loaded from its file under a private package name, so these tests neither need
the C++ extension nor run ``ep_backend/__init__.py``.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_utils import RemoteTraceback, run_distributed

_SPEC_PACKAGE = "_ep_backend_spec"


def _load_reference() -> types.ModuleType:
    """Import ``ep_backend/reference.py`` (and ``handles.py``) without ``ep_backend/__init__``."""
    if _SPEC_PACKAGE not in sys.modules:
        package = types.ModuleType(_SPEC_PACKAGE)
        package.__path__ = [str(Path(__file__).resolve().parents[1] / "ep_backend")]
        sys.modules[_SPEC_PACKAGE] = package
    return importlib.import_module(f"{_SPEC_PACKAGE}.reference")


ref = _load_reference()

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------
# Helpers shared by the oracles
# --------------------------------------------------------------------------------------------


def assert_bitwise_equal(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    """Same dtype, same shape, same bytes (works for float8 and treats NaN == NaN)."""
    assert actual is not None, f"{what}: got None"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a = actual.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = expected.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: values differ\nactual:\n{actual}\nexpected:\n{expected}")


def stack_rows(rows: list[torch.Tensor], row_shape: tuple[int, ...], dtype: torch.dtype):
    """``torch.stack`` for any dtype (float8 included), ``[0, *row_shape]`` when empty."""
    if not rows:
        return torch.empty((0, *row_shape), dtype=dtype)
    return torch.stack([r.contiguous().view(torch.uint8) for r in rows]).view(dtype)


def make_generator(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1_000_003 + k + 7
    return torch.Generator().manual_seed(seed % (2**62))


def random_topk(
    gen: torch.Generator,
    num_tokens: int,
    num_topk: int,
    num_experts: int,
    drop: float,
    duplicate: bool,
) -> torch.Tensor:
    """int64 ``[T, K]``: distinct experts per token, some ``-1``; token 1 selects nothing."""
    topk = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :num_topk]
    topk[torch.rand(num_tokens, num_topk, generator=gen) < drop] = -1
    if num_tokens > 1:
        topk[1] = -1
    if duplicate and num_tokens > 2 and num_topk > 1:
        topk[2, 1] = topk[2, 0] = num_experts - 1  # the same expert twice
    return topk


def round_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# --------------------------------------------------------------------------------------------
# Oracle FP8 quantiser (per group, written with frexp instead of bit tricks)
# --------------------------------------------------------------------------------------------


def oracle_quantize_row(
    row: torch.Tensor, round_scale: bool, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise one token ``[H]``; returns ``(q [H] fp8, scales [H/128] f32 or [H/512] i32)``."""
    groups = row.shape[0] // 128
    q_parts, scales, exponents = [], [], []
    for g in range(groups):
        seg = row[g * 128 : (g + 1) * 128].float()
        amax = torch.maximum(seg.abs().max(), torch.tensor(1e-4, dtype=torch.float32))
        scale = amax / torch.tensor(448.0, dtype=torch.float32)
        if round_scale:
            mantissa, exponent = math.frexp(float(scale))  # scale = mantissa * 2**exponent
            power = float(scale) if mantissa == 0.5 else 2.0**exponent
            scale = torch.tensor(power, dtype=torch.float32)
            exponents.append(int(math.log2(power)) + 127)
        inv = torch.tensor(1.0, dtype=torch.float32) / scale
        q_parts.append((seg * inv).clamp(-448.0, 448.0).to(FP8))
        scales.append(float(scale))
    q = stack_rows(q_parts, (128,), FP8).reshape(-1)
    if not use_ue8m0:
        return q, torch.tensor(scales, dtype=torch.float32)
    words = []
    for i in range(groups // 4):
        word = sum(exponents[4 * i + j] << (8 * j) for j in range(4))
        words.append(word - 2**32 if word >= 2**31 else word)
    return q, torch.tensor(words, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# Unit tests (single process)
# --------------------------------------------------------------------------------------------


def _oracle_layout(topk: torch.Tensor, num_experts: int, num_ranks: int):
    epr = num_experts // num_ranks
    per_rank = [0] * num_ranks
    per_expert = [0] * num_experts
    in_rank = []
    for ids in topk.tolist():
        ranks = {e // epr for e in ids if e >= 0}
        for e in ids:
            if e >= 0:
                per_expert[e] += 1
        for r in ranks:
            per_rank[r] += 1
        in_rank.append([r in ranks for r in range(num_ranks)])
    return (
        torch.tensor(per_rank, dtype=torch.int32),
        torch.tensor(per_expert, dtype=torch.int32),
        torch.tensor(in_rank, dtype=torch.bool).reshape(len(in_rank), num_ranks),
    )


@pytest.mark.parametrize(
    ("num_tokens", "num_topk", "num_experts", "num_ranks", "idx_dtype"),
    [
        (0, 4, 8, 2, torch.int64),
        (1, 1, 4, 4, torch.int64),
        (23, 8, 32, 4, torch.int32),
        (17, 32, 64, 8, torch.int64),
        (9, 3, 6, 1, torch.int32),
    ],
)
def test_get_dispatch_layout(num_tokens, num_topk, num_experts, num_ranks, idx_dtype):
    gen = make_generator(num_tokens, num_topk, num_experts)
    topk = random_topk(gen, num_tokens, num_topk, num_experts, 0.3, duplicate=True).to(idx_dtype)
    layout = ref.get_dispatch_layout(topk, num_experts, num_ranks)
    per_rank, per_expert, in_rank = _oracle_layout(topk, num_experts, num_ranks)
    assert_bitwise_equal(layout.num_tokens_per_rank, per_rank, "num_tokens_per_rank")
    assert_bitwise_equal(layout.num_tokens_per_expert, per_expert, "num_tokens_per_expert")
    assert_bitwise_equal(layout.is_token_in_rank, in_rank, "is_token_in_rank")
    a, _, c = layout  # DispatchLayout unpacks like a tuple
    assert a is layout.num_tokens_per_rank and c is layout.is_token_in_rank


def test_get_dispatch_layout_rejects_bad_ids():
    with pytest.raises(AssertionError, match="topk_idx values"):
        ref.get_dispatch_layout(torch.tensor([[0, 8]]), 8, 2)
    with pytest.raises(AssertionError, match="topk_idx values"):
        ref.get_dispatch_layout(torch.tensor([[-2, 1]]), 8, 2)
    with pytest.raises(AssertionError, match="multiple"):
        ref.get_dispatch_layout(torch.tensor([[0, 1]]), 6, 4)


@pytest.mark.parametrize(
    ("round_scale", "use_ue8m0"), [(False, False), (True, False), (True, True)]
)
def test_quantize_fp8_matches_oracle(round_scale, use_ue8m0):
    gen = make_generator(11, int(round_scale), int(use_ue8m0))
    x = (torch.randn(5, 1024, generator=gen) * torch.logspace(-6, 4, 5).unsqueeze(1)).to(BF16)
    x[0, :128] = 0.0  # amax clamps to 1e-4
    x[1, 128:256] = 3.0e38  # huge values, still finite scales
    q, scales = ref.quantize_fp8_per128(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    if use_ue8m0:
        assert scales.dtype == torch.int32 and scales.shape == (5, 2)
    else:
        assert scales.dtype == torch.float32 and scales.shape == (5, 8)
    assert scales.is_contiguous()
    for t in range(x.shape[0]):
        q_exp, s_exp = oracle_quantize_row(x[t], round_scale, use_ue8m0)
        assert_bitwise_equal(q[t], q_exp, f"q[{t}]")
        assert_bitwise_equal(scales[t], s_exp, f"scales[{t}]")


def test_quantize_fp8_known_values():
    x = torch.ones(1, 512, dtype=torch.float32)
    x[0, 128:256] = -2.0
    q, scales = ref.quantize_fp8_per128(x)
    expected_scale = torch.tensor(1.0, dtype=torch.float32) / 448.0
    assert scales[0, 0] == expected_scale and scales[0, 1] == 2 * expected_scale
    assert torch.all(q.float()[0, :128] == 448.0) and torch.all(q.float()[0, 128:256] == -448.0)
    # round_scale: 1/448 rounds up to 2**-8; 2/448 to 2**-7; q = 1 / 2**-8 = 256.
    q, scales = ref.quantize_fp8_per128(x, round_scale=True)
    assert scales[0].tolist() == [2.0**-8, 2.0**-7, 2.0**-8, 2.0**-8]
    assert torch.all(q.float()[0, :128] == 256.0)
    # UE8M0: biased exponents 119, 120, 119, 119 packed little-endian into one int32.
    _, packed = ref.quantize_fp8_per128(x, round_scale=True, use_ue8m0=True)
    assert packed.tolist() == [[119 | 120 << 8 | 119 << 16 | 119 << 24]]
    assert ref.unpack_ue8m0(packed).tolist() == [[2.0**-8, 2.0**-7, 2.0**-8, 2.0**-8]]
    # An exact power of two stays put when rounding.
    p = torch.full((1, 128), 448.0 * 2.0**-3)
    assert ref.quantize_fp8_per128(p, round_scale=True)[1].item() == 2.0**-3


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize(
    ("round_scale", "use_ue8m0"), [(False, False), (True, False), (True, True)]
)
def test_quantize_fp8_cuda_matches_cpu(round_scale, use_ue8m0):
    x = (torch.randn(64, 1024, generator=make_generator(13)) * 3).to(BF16)
    q, scales = ref.quantize_fp8_per128(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    q_cuda, scales_cuda = ref.quantize_fp8_per128(x.cuda(), round_scale, use_ue8m0)
    assert_bitwise_equal(q_cuda, q, "q on CUDA")
    assert_bitwise_equal(scales_cuda, scales, "scales on CUDA")


@pytest.mark.parametrize(("round_scale", "use_ue8m0"), [(False, False), (True, True)])
def test_dequantize_fp8_roundtrip(round_scale, use_ue8m0):
    gen = make_generator(12)
    x = (torch.randn(4, 3, 512, generator=gen) * 10).to(BF16)
    q, scales = ref.quantize_fp8_per128(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert q.shape == x.shape and scales.shape[:2] == (4, 3)
    y = ref.dequantize_fp8_per128(q, scales)
    assert y.dtype == torch.float32 and y.shape == x.shape
    step = ref.unpack_ue8m0(scales) if use_ue8m0 else scales
    bound = x.float().abs() / 16 + step.repeat_interleave(128, dim=-1) * 2.0**-9
    assert torch.all((y - x.float()).abs() <= bound)


def test_ue8m0_pack_roundtrip():
    exponents = torch.tensor([[0, 1, 127, 254, 255, 128, 3, 200]])
    scales = (exponents << 23).to(torch.int32).view(torch.float32)
    packed = ref.pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert_bitwise_equal(ref.unpack_ue8m0(packed), scales, "unpack(pack(s))")


# --------------------------------------------------------------------------------------------
# High-throughput dispatch / combine
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HTCase:
    """One high-throughput scenario; ``tokens[r]`` is ``T`` on rank ``r``."""

    tokens: tuple[int, ...]
    hidden: int
    num_topk: int
    num_experts: int
    dtype: torch.dtype
    scales: torch.dtype | None = None  # FP8 scales [T, ceil(H/128)], passed through
    idx_dtype: torch.dtype = torch.int64
    with_weights: bool = True
    drop: float = 0.25
    duplicate: bool = False
    seed: int = 0


@dataclass
class RankInputs:
    x: torch.Tensor
    scales: torch.Tensor | None
    topk: torch.Tensor
    weights: torch.Tensor | None


def make_ht_inputs(case: HTCase, rank: int) -> RankInputs:
    gen = make_generator(case.seed, rank, 1)
    num_tokens = case.tokens[rank]
    topk = random_topk(
        gen, num_tokens, case.num_topk, case.num_experts, case.drop, case.duplicate
    ).to(case.idx_dtype)
    x = torch.randn(num_tokens, case.hidden, generator=gen) * 100
    x = x.to(case.dtype)
    scales = None
    if case.scales is not None:
        num_scales = (case.hidden + 127) // 128
        if case.scales == torch.int32:
            scales = torch.randint(-(2**31), 2**31 - 1, (num_tokens, num_scales), generator=gen)
            scales = scales.to(torch.int32)
        else:
            scales = torch.rand(num_tokens, num_scales, generator=gen)
        scales = scales.t().contiguous().t()  # column-major, as DeepEP's tests pass them
    weights = None
    if case.with_weights:
        weights = torch.rand(num_tokens, case.num_topk, generator=gen) + 0.5
    return RankInputs(x, scales, topk, weights)


@dataclass
class ExpectedDispatch:
    src: list[tuple[int, int]]  # (source rank, source token) of each received row
    x: torch.Tensor
    scales: torch.Tensor | None
    topk: torch.Tensor
    weights: torch.Tensor | None
    per_expert: list[int]  # unaligned
    recv_per_rank: list[int]


def oracle_dispatch(case: HTCase, inputs: list[RankInputs], me: int) -> ExpectedDispatch:
    """Rows rank ``me`` receives, by plain loops over source ranks and tokens."""
    num_ranks = len(inputs)
    epr = case.num_experts // num_ranks
    src, xs, ss, topks, ws = [], [], [], [], []
    per_expert = [0] * epr
    recv_per_rank = [0] * num_ranks
    for s, inp in enumerate(inputs):
        for t, ids in enumerate(inp.topk.tolist()):
            local = [e - me * epr if e >= 0 and e // epr == me else -1 for e in ids]
            if all(le < 0 for le in local):
                continue
            src.append((s, t))
            recv_per_rank[s] += 1
            xs.append(inp.x[t])
            if inp.scales is not None:
                ss.append(inp.scales[t])
            topks.append(local)
            if inp.weights is not None:
                w = inp.weights[t].tolist()
                ws.append([w[k] if local[k] >= 0 else 0.0 for k in range(len(local))])
            for le in local:
                if le >= 0:
                    per_expert[le] += 1
    k = case.num_topk
    num_scales = (case.hidden + 127) // 128
    return ExpectedDispatch(
        src=src,
        x=stack_rows(xs, (case.hidden,), case.dtype),
        scales=stack_rows(ss, (num_scales,), case.scales) if case.scales is not None else None,
        topk=torch.tensor(topks, dtype=case.idx_dtype).reshape(len(src), k),
        weights=(
            torch.tensor(ws, dtype=torch.float32).reshape(len(src), k)
            if case.with_weights
            else None
        ),
        per_expert=per_expert,
        recv_per_rank=recv_per_rank,
    )


def check_dispatch(
    out: Any,
    exp: ExpectedDispatch,
    case: HTCase,
    rank: int,
    alignment: int,
    num_worst_tokens: int,
) -> None:
    """Compare a dispatch result with the oracle (valid rows bitwise, padding as specified)."""
    n = len(exp.src)
    rows = num_worst_tokens or n
    num_ranks = len(exp.recv_per_rank)
    assert out.work is None
    assert out.recv_x.shape == (rows, case.hidden)
    assert_bitwise_equal(out.recv_x[:n], exp.x, "recv_x")
    if case.scales is None:
        assert out.recv_x_scales is None
    else:
        assert out.recv_x_scales.shape[0] == rows
        assert_bitwise_equal(out.recv_x_scales[:n], exp.scales, "recv_x_scales")
    assert_bitwise_equal(out.recv_topk_idx[:n], exp.topk, "recv_topk_idx")
    if case.with_weights:
        assert_bitwise_equal(out.recv_topk_weights[:n], exp.weights, "recv_topk_weights")
    else:
        assert out.recv_topk_weights is None
    aligned = [round_up(c, alignment) for c in exp.per_expert]
    assert_bitwise_equal(
        out.num_recv_tokens_per_expert, torch.tensor(aligned, dtype=torch.int32), "per expert"
    )
    assert out.num_recv_tokens_per_expert_list == (aligned if num_worst_tokens == 0 else [])

    h = out.handle
    assert h.num_ranks == num_ranks and h.num_experts == case.num_experts
    assert h.num_worst_tokens == num_worst_tokens and h.num_recv_rows == rows
    per_rank, _, in_rank = _oracle_layout(
        make_ht_inputs(case, rank).topk, case.num_experts, num_ranks
    )
    assert_bitwise_equal(h.is_token_in_rank, in_rank, "handle.is_token_in_rank")
    assert_bitwise_equal(h.num_tokens_per_rank, per_rank, "handle.num_tokens_per_rank")
    assert_bitwise_equal(
        h.num_recv_tokens_per_rank,
        torch.tensor(exp.recv_per_rank, dtype=torch.int32),
        "handle.num_recv_tokens_per_rank",
    )
    src_idx = [t for _, t in exp.src] + [-1] * (rows - n)
    src_rank = [s for s, _ in exp.src] + [-1] * (rows - n)
    assert_bitwise_equal(h.recv_src_idx, torch.tensor(src_idx, dtype=torch.int32), "src_idx")
    assert_bitwise_equal(h.recv_src_rank, torch.tensor(src_rank, dtype=torch.int32), "src_rank")

    if num_worst_tokens:  # the reference zero-fills; implementations may leave garbage
        pad = slice(n, rows)
        assert torch.all(out.recv_x[pad].view(torch.uint8) == 0)
        if out.recv_x_scales is not None:
            assert torch.all(out.recv_x_scales[pad].view(torch.uint8) == 0)
        assert torch.all(out.recv_topk_idx[pad] == -1)
        if out.recv_topk_weights is not None:
            assert torch.all(out.recv_topk_weights[pad] == 0)


def combine_dtype(case: HTCase) -> torch.dtype:
    return BF16 if case.dtype == FP8 else case.dtype


def combine_rows(case: HTCase, owner: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank ``owner`` returns for (source rank s, token t): ``(Y[s, t, H], W[s, t, K])``."""
    gen = make_generator(case.seed, owner, 2)
    max_tokens = max(case.tokens)
    y = torch.randn(num_ranks, max_tokens, case.hidden, generator=gen) * 10
    w = torch.rand(num_ranks, max_tokens, case.num_topk, generator=gen)
    return y.to(combine_dtype(case)), w


def build_combine_input(case: HTCase, handle: Any, rank: int, num_ranks: int, device: str):
    """Combine input on ``rank`` in the dispatch layout of ``handle``; padding rows are NaN."""
    y, w = combine_rows(case, rank, num_ranks)
    rows = handle.num_recv_rows
    x = torch.full((rows, case.hidden), float("nan"), dtype=y.dtype)
    topk_w = torch.full((rows, case.num_topk), float("nan"), dtype=torch.float32)
    src_rank, src_idx = handle.recv_src_rank.cpu(), handle.recv_src_idx.cpu()
    valid = src_rank >= 0
    s, t = src_rank[valid].long(), src_idx[valid].long()
    x[valid], topk_w[valid] = y[s, t], w[s, t]
    return x.to(device), topk_w.to(device)


def oracle_combine(case: HTCase, rank: int, num_ranks: int, biases: tuple[torch.Tensor, ...]):
    """``combined_x`` and ``combined_topk_weights`` on ``rank``, token by token."""
    _, _, in_rank = _oracle_layout(make_ht_inputs(case, rank).topk, case.num_experts, num_ranks)
    returned = [combine_rows(case, r, num_ranks) for r in range(num_ranks)]
    dtype = combine_dtype(case)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    xs, ws = [], []
    for t in range(case.tokens[rank]):
        acc = torch.zeros(case.hidden, dtype=acc_dtype)
        acc_w = torch.zeros(case.num_topk, dtype=torch.float32)
        for r in range(num_ranks):
            if in_rank[t, r]:
                acc = acc + returned[r][0][rank, t].to(acc_dtype)
                acc_w = acc_w + returned[r][1][rank, t]
        for b in biases:
            acc = acc + b[t].to(acc_dtype)
        xs.append(acc.to(dtype))
        ws.append(acc_w)
    return stack_rows(xs, (case.hidden,), dtype), stack_rows(ws, (case.num_topk,), torch.float32)


def _to(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _ht_worker(rank: int, world_size: int, case: HTCase, device: str = "cpu") -> None:
    inputs = [make_ht_inputs(case, r) for r in range(world_size)]  # CPU, for the oracle
    cpu = inputs[rank]
    mine = RankInputs(*(_to(t, device) for t in (cpu.x, cpu.scales, cpu.topk, cpu.weights)))
    exp = oracle_dispatch(case, inputs, rank)
    args = (mine.x, mine.topk, mine.weights, case.num_experts)

    # Plain dispatch, two alignments.
    for alignment in (1, 4):
        out = ref.dispatch(*args, x_scales=mine.scales, expert_alignment=alignment)
        check_dispatch(out, exp, case, rank, alignment, 0)
    handle = out.handle

    # Combine: no extras; one bias + weights; two biases of different dtypes + weights.
    gen = make_generator(case.seed, rank, 3)
    bias0 = (torch.randn(case.tokens[rank], case.hidden, generator=gen) * 10).to(BF16)
    bias1 = torch.randn(case.tokens[rank], case.hidden, generator=gen).to(combine_dtype(case))
    bias0_d, bias1_d = bias0.to(device), bias1.to(device)
    y, y_w = build_combine_input(case, handle, rank, world_size, device)
    for biases in ((), (bias0,), (bias0, bias1)):
        with_w = len(biases) > 0
        bias = (bias0_d, bias1_d) if len(biases) == 2 else bias0_d if biases else None
        res = ref.combine(y, handle, topk_weights=y_w if with_w else None, bias=bias)
        exp_x, exp_w = oracle_combine(case, rank, world_size, biases)
        assert res.work is None
        assert_bitwise_equal(res.combined_x, exp_x, f"combined_x (bias={len(biases)})")
        if with_w:
            assert_bitwise_equal(res.combined_topk_weights, exp_w, "combined_topk_weights")
        else:
            assert res.combined_topk_weights is None

    # Combining the dispatched weights gives back the original weights of routed tokens.
    if case.with_weights:
        res = ref.combine(out.recv_x.to(combine_dtype(case)), handle, out.recv_topk_weights)
        expected_w = torch.where(cpu.topk >= 0, cpu.weights, 0.0)
        assert_bitwise_equal(res.combined_topk_weights, expected_w, "round-trip weights")

    # Cached dispatch: new payload, same routing.
    x2 = (mine.x.float() * -3 + 1).to(case.dtype)
    cached = ref.dispatch(x2, handle=handle, x_scales=mine.scales)
    rows2 = [inputs[s].x.float()[t] * -3 + 1 for s, t in exp.src]
    exp_x2 = stack_rows(rows2, (case.hidden,), torch.float32).to(case.dtype)
    assert_bitwise_equal(cached.recv_x, exp_x2, "cached recv_x")
    if case.scales is not None:
        assert_bitwise_equal(cached.recv_x_scales, exp.scales, "cached recv_x_scales")
    assert cached.handle is handle and cached.recv_topk_idx is None
    assert cached.recv_topk_weights is None and cached.num_recv_tokens_per_expert is None
    assert cached.num_recv_tokens_per_expert_list == []

    # Fixed capacity: worst = the largest receive count over all ranks, plus 3.
    counts = [len(oracle_dispatch(case, inputs, r).src) for r in range(world_size)]
    worst = max(counts) + 3
    out_w = ref.dispatch(*args, x_scales=mine.scales, expert_alignment=4, num_worst_tokens=worst)
    check_dispatch(out_w, exp, case, rank, 4, worst)
    cached_w = ref.dispatch(x2, handle=out_w.handle, x_scales=mine.scales)
    assert cached_w.recv_x.shape == (worst, case.hidden)
    assert_bitwise_equal(cached_w.recv_x[: len(exp.src)], exp_x2, "cached padded recv_x")
    y, y_w = build_combine_input(case, out_w.handle, rank, world_size, device)
    res = ref.combine(y, out_w.handle, topk_weights=y_w, bias=bias0_d)
    exp_x, exp_w = oracle_combine(case, rank, world_size, (bias0,))
    assert_bitwise_equal(res.combined_x, exp_x, "combined_x with num_worst_tokens")
    assert_bitwise_equal(res.combined_topk_weights, exp_w, "combined weights, num_worst_tokens")

    # Too small a capacity raises on every rank, and the group stays usable.
    if max(counts) > 1:
        with pytest.raises(RuntimeError, match="num_worst_tokens"):
            ref.dispatch(*args, num_worst_tokens=max(counts) - 1)
        check_dispatch(ref.dispatch(*args, x_scales=mine.scales), exp, case, rank, 1, 0)


HT_CASES = [
    pytest.param(1, HTCase((9,), 64, 4, 8, torch.float32), id="r1-f32"),
    pytest.param(2, HTCase((13, 0), 200, 8, 16, BF16), id="r2-bf16-h200-k8-empty-rank"),
    pytest.param(
        2,
        HTCase((9, 17), 64, 1, 4, torch.float32, idx_dtype=torch.int32, drop=0.3, seed=1),
        id="r2-f32-k1-int32idx",
    ),
    pytest.param(
        2,
        HTCase((11, 6), 256, 32, 64, FP8, scales=torch.float32, with_weights=False, seed=2),
        id="r2-fp8-k32-noweights",
    ),
    pytest.param(
        4, HTCase((7, 0, 19, 3), 200, 8, 32, BF16, duplicate=True, seed=3), id="r4-bf16-h200"
    ),
    pytest.param(
        4,
        HTCase((5, 12, 0, 9), 128, 32, 64, FP8, scales=torch.int32, idx_dtype=torch.int32, seed=4),
        id="r4-fp8-int32scales-k32",
    ),
    pytest.param(
        4, HTCase((0, 4, 10, 1), 24, 2, 8, torch.float64, drop=0.5, seed=5), id="r4-f64-k2"
    ),
]


@pytest.mark.parametrize(("world_size", "case"), HT_CASES)
def test_dispatch_combine(world_size: int, case: HTCase) -> None:
    assert len(case.tokens) == world_size
    run_distributed(_ht_worker, world_size, case)


# --------------------------------------------------------------------------------------------
# Low-latency dispatch / combine
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LLCase:
    tokens: tuple[int, ...]
    max_tokens: int  # M
    hidden: int
    num_topk: int
    num_experts: int
    idx_dtype: torch.dtype = torch.int64
    seed: int = 0


LL_MODES = [  # (use_fp8, round_scale, use_ue8m0)
    (False, False, False),
    (True, False, False),
    (True, True, False),
    (True, True, True),
]


def make_ll_inputs(case: LLCase, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x BF16 [T, H], topk_idx [T, K], topk_weights f32 [T, K])``; NaN weights where -1."""
    gen = make_generator(case.seed, rank, 4)
    num_tokens = case.tokens[rank]
    topk = random_topk(gen, num_tokens, case.num_topk, case.num_experts, 0.2, duplicate=True)
    x = (torch.randn(num_tokens, case.hidden, generator=gen) * 3).to(BF16)
    weights = torch.randn(num_tokens, case.num_topk, generator=gen)
    weights[topk < 0] = float("nan")  # must be skipped, not multiplied
    return x, topk.to(case.idx_dtype), weights


def ll_expert_outputs(case: LLCase, owner: int, num_ranks: int) -> torch.Tensor:
    """BF16 ``[E_loc, R, M, H]``: what expert ``le`` on ``owner`` outputs for token (s, t)."""
    gen = make_generator(case.seed, owner, 5)
    epr = case.num_experts // num_ranks
    shape = (epr, num_ranks, case.max_tokens, case.hidden)
    return (torch.randn(shape, generator=gen) * 4).to(BF16)


def _ll_worker(rank: int, world_size: int, case: LLCase, device: str = "cpu") -> None:
    epr = case.num_experts // world_size
    slots = world_size * case.max_tokens
    inputs = [make_ll_inputs(case, r) for r in range(world_size)]
    x, topk, weights = (t.to(device) for t in inputs[rank])

    # Oracle layout: for each local expert, (s, t, k) by source rank, token, k.
    entries: list[list[tuple[int, int]]] = [[] for _ in range(epr)]
    ranges = torch.zeros(epr, world_size, dtype=torch.int64)
    for le in range(epr):
        for s in range(world_size):
            begin = len(entries[le])
            for t, ids in enumerate(inputs[s][1].tolist()):
                entries[le].extend((s, t) for e in ids if e == rank * epr + le)
            ranges[le, s] = (begin << 32) | (len(entries[le]) - begin)
    counts = torch.tensor([len(e) for e in entries], dtype=torch.int32)
    src_info = torch.full((epr, slots), -1, dtype=torch.int32)
    for le in range(epr):
        for i, (_, t) in enumerate(entries[le]):
            src_info[le, i] = t

    stats_start = torch.arange(epr, dtype=torch.int32) * 7
    stats = stats_start.to(device, copy=True)
    quantized: dict[tuple[int, int, bool, bool], tuple[torch.Tensor, torch.Tensor]] = {}
    for use_fp8, round_scale, use_ue8m0 in LL_MODES:
        out = ref.low_latency_dispatch(
            x,
            topk,
            case.max_tokens,
            case.num_experts,
            use_fp8=use_fp8,
            round_scale=round_scale,
            use_ue8m0=use_ue8m0,
            cumulative_local_expert_recv_stats=stats,
        )
        mode = f"fp8={use_fp8} round={round_scale} ue8m0={use_ue8m0}"
        assert out.hook is None and out.work is None
        assert_bitwise_equal(out.recv_count, counts, f"recv_count {mode}")
        h = out.handle
        assert_bitwise_equal(h.src_info, src_info, f"src_info {mode}")
        assert_bitwise_equal(h.layout_range, ranges, f"layout_range {mode}")
        assert (h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts, h.num_ranks) == (
            case.max_tokens,
            case.hidden,
            case.num_experts,
            world_size,
        )
        assert h.buffer_index == 0

        # Expected payload: the (sender-side quantised) token in every valid slot, zeros after.
        exp_x = torch.zeros(epr, slots, case.hidden, dtype=FP8 if use_fp8 else BF16)
        exp_s = None
        if use_fp8:
            groups = case.hidden // (512 if use_ue8m0 else 128)
            exp_s = torch.zeros(
                epr, slots, groups, dtype=torch.int32 if use_ue8m0 else torch.float32
            )
        for le in range(epr):
            for i, (s, t) in enumerate(entries[le]):
                row = inputs[s][0][t]
                if not use_fp8:
                    exp_x[le, i] = row
                    continue
                key = (s, t, round_scale, use_ue8m0)
                if key not in quantized:
                    quantized[key] = oracle_quantize_row(row, round_scale, use_ue8m0)
                exp_x[le, i], exp_s[le, i] = quantized[key]
        assert_bitwise_equal(out.recv_x, exp_x, f"recv_x {mode}")
        if use_fp8:
            assert out.recv_x_scales.is_contiguous()
            assert_bitwise_equal(out.recv_x_scales, exp_s, f"recv_x_scales {mode}")
        else:
            assert out.recv_x_scales is None

        # Combine: expert le on this rank outputs G[le, s, t] for token (s, t); other slots NaN.
        g = ll_expert_outputs(case, rank, world_size)
        y = torch.full((epr, slots, case.hidden), float("nan"), dtype=BF16)
        for le in range(epr):
            for i, (s, t) in enumerate(entries[le]):
                y[le, i] = g[le, s, t]
        use_out = use_fp8 and not round_scale
        buf = None
        if use_out:
            buf = torch.full((case.tokens[rank], case.hidden), 5.0, dtype=BF16, device=device)
        combined = ref.low_latency_combine(y.to(device), topk, weights, h, out=buf)
        if use_out:
            assert combined is buf

        owners = [ll_expert_outputs(case, r, world_size) for r in range(world_size)]
        rows = []
        cpu_topk, cpu_weights = inputs[rank][1], inputs[rank][2]
        for t, ids in enumerate(cpu_topk.tolist()):
            acc = torch.zeros(case.hidden, dtype=torch.float32)
            for k, e in enumerate(ids):
                if e >= 0:
                    acc = acc + cpu_weights[t, k] * owners[e // epr][e % epr, rank, t].float()
            rows.append(acc.to(BF16))
        assert_bitwise_equal(combined, stack_rows(rows, (case.hidden,), BF16), f"combine {mode}")

    assert_bitwise_equal(stats, stats_start + len(LL_MODES) * counts, "cumulative stats")


LL_CASES = [
    pytest.param(1, LLCase((6,), 8, 512, 3, 4), id="r1"),
    pytest.param(2, LLCase((5, 0), 8, 512, 3, 8, seed=1), id="r2-empty-rank"),
    pytest.param(2, LLCase((7, 4), 8, 512, 8, 16, idx_dtype=torch.int32, seed=2), id="r2-k8"),
    pytest.param(4, LLCase((3, 7, 0, 6), 8, 512, 5, 16, seed=3), id="r4"),
]


@pytest.mark.parametrize(("world_size", "case"), LL_CASES)
def test_low_latency(world_size: int, case: LLCase) -> None:
    assert len(case.tokens) == world_size
    run_distributed(_ll_worker, world_size, case)


# --------------------------------------------------------------------------------------------
# The spawn helper itself
# --------------------------------------------------------------------------------------------


def _failing_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one failed on purpose")
    torch.distributed.barrier()  # would wait forever for rank 1 without the helper's cleanup
    return rank


def test_run_distributed_reraises_worker_error() -> None:
    with pytest.raises(ValueError, match="on purpose") as info:
        run_distributed(_failing_worker, 2, timeout=60)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "[rank 1]" in str(cause)
    assert "_failing_worker" in str(cause)


# --------------------------------------------------------------------------------------------
# The same checks on CUDA with NCCL (skipped without 2 GPUs)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize(
    ("worker", "case"),
    [
        pytest.param(_ht_worker, HT_CASES[1].values[1], id="ht-bf16-h200"),
        pytest.param(_ht_worker, HT_CASES[3].values[1], id="ht-fp8-k32"),
        pytest.param(_ll_worker, LL_CASES[2].values[1], id="ll-k8"),
    ],
)
def test_reference_on_cuda_nccl(worker: Any, case: Any) -> None:
    run_distributed(worker, 2, case, "cuda", backend="nccl")
