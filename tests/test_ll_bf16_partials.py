"""``Options.low_latency_combine_bf16_partials``: each expert rank's sum of a token's entries is
rounded to BF16 before the ranks' sums are added.

The reference's model of it (``reference.low_latency_combine(per_rank_partials=...)``) on hand-made
values; the ATen path (CPU, Gloo) bit for bit that model with the option on and the ``k``-order
reference with it off; the option changes the bits and stays within the rounding it adds; ranks
that disagree on it raise on every rank. The NVSHMEM kernels are checked against the same model
in ``test_moe_gpu.py::test_low_latency_bf16_partials_match_reference``; masked ranks in
``test_rank_mask.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _dist_utils import run_distributed
from moe_helpers import Mismatches, make_generator, random_topk, single_thread

from ep_backend import reference

HIDDEN = 256
TOPK = 8
MAX_TOKENS = 48


def test_each_ranks_sum_is_rounded_once_and_single_entries_are_not() -> None:
    # Experts 0, 1 on rank 0 and 2, 3 on rank 1. Token 0: entries k = 0, 2 on rank 0 (a sum),
    # k = 1 on rank 1 (a single entry); y = 1, 2^-8, 2^-8, all weights 1.
    idx = torch.tensor([[0, 2, 1], [3, -1, 2]])
    weights = torch.ones(2, 3)
    y = torch.zeros(2, 3, 1)
    y[0, :, 0] = torch.tensor([1.0, 2.0**-8, 2.0**-8])
    # Token 1: entries k = 0, 2 on rank 1, w = 0.5, y = 1 + 2^-7 and 2^-7: the sum
    # 0.5 + 2^-8 + 2^-8 = 0.5078125 is exact in BF16.
    y[1, :, 0] = torch.tensor([1.0 + 2.0**-7, 0.0, 2.0**-7])
    weights[1] = 0.5

    def combined(bf16: bool) -> list[float]:
        out = reference._sum_of_rank_partials(idx, weights, y, 2, bf16)
        assert out.dtype == torch.bfloat16
        return out.float().squeeze(1).tolist()

    # float32 partials: (1 + 2^-8) + 2^-8 = 1 + 2^-7, a BF16 value.
    assert combined(False) == [1.0 + 2.0**-7, 0.5 + 2.0**-7]
    # BF16 partials: 1 + 2^-8 rounds (tie, to even) to 1; 1 + 2^-8 again rounds to 1.
    assert combined(True) == [1.0, 0.5 + 2.0**-7]


def _inputs(rank: int, world: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = make_generator(seed, rank)
    num_tokens = [MAX_TOKENS, 17, 0, 31][rank % 4]
    x = (torch.randn((num_tokens, HIDDEN), generator=gen) * 4).to(torch.bfloat16)
    idx = random_topk(gen, num_tokens, TOPK, 4 * world)
    weights = torch.rand((num_tokens, TOPK), generator=gen)
    return x, idx, weights


def _ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(v)
    return torch.where(v > 0, torch.ldexp(torch.ones_like(v), exponent - 8), 0.0)


def _option_worker(rank: int, world: int) -> dict:
    import ep_backend as ep

    single_thread()
    m = Mismatches(context=f"rank {rank}")
    options = ep.get_backend().options
    changed = 0
    for seed in range(3):
        x, idx, w = _inputs(rank, world, seed)
        experts = 4 * world
        want_d = reference.low_latency_dispatch(x, idx, MAX_TOKENS, experts, use_fp8=False)
        gen = make_generator(seed, rank, 99)
        y = torch.randn(want_d.recv_x.shape, generator=gen).to(torch.bfloat16)
        k_order = reference.low_latency_combine(y, idx, w, want_d.handle)
        rounded = reference.low_latency_combine(
            y, idx, w, want_d.handle, per_rank_partials=torch.bfloat16
        )
        magnitude = reference.low_latency_combine(y.abs(), idx, w, want_d.handle)
        for bf16 in (False, True):
            options.low_latency_combine_bf16_partials = bf16
            got_d = ep.low_latency_dispatch(x, idx, MAX_TOKENS, experts, use_fp8=False)
            got = ep.low_latency_combine(y, idx, w, got_d.handle)
            m.bitwise(got, rounded if bf16 else k_order, f"seed {seed}, bf16 partials {bf16}")
        changed += int((rounded != k_order).sum())
        # One more rounding of each rank's sum: at most 2^-8 of the partial (BF16 keeps 8
        # significant bits), and the partials' magnitudes add up to at most sum |w y| (read
        # from a BF16 output: 1 % more); plus half an ulp of each output's own rounding.
        larger = torch.maximum(rounded.float().abs(), k_order.float().abs())
        bound = _ulp_bf16(larger) + magnitude.float() * 1.01 * 2.0**-8
        beyond = int(((rounded.float() - k_order.float()).abs() > bound).sum())
        m.check(beyond == 0, f"seed {seed}: {beyond} outputs beyond the added rounding")
    options.low_latency_combine_bf16_partials = False
    return {"mismatches": m.items, "changed": changed}


@pytest.mark.parametrize("world", [2, 3])
def test_aten_path_gives_the_models_bits(world: int) -> None:
    results = run_distributed(_option_worker, world, backend="ep", timeout=180)
    for r in results:
        assert r["mismatches"] == [], r["mismatches"]
    # The option took effect: some outputs differ from the k-order sum's (rank 2 has no tokens).
    assert sum(r["changed"] for r in results) > 0, results


def _disagree_worker(rank: int, world: int) -> str:
    import ep_backend as ep

    single_thread()
    x, idx, w = _inputs(rank, world, 0)
    d = ep.low_latency_dispatch(x, idx, MAX_TOKENS, 4 * world, use_fp8=False)
    y = torch.zeros(d.recv_x.shape, dtype=torch.bfloat16)
    ep.get_backend().options.low_latency_combine_bf16_partials = rank == 0
    try:
        ep.low_latency_combine(y, idx, w, d.handle)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_on_the_option_raise_everywhere() -> None:
    for message in run_distributed(_disagree_worker, 2, backend="ep", timeout=120):
        assert "ranks disagree on Options.low_latency_combine_bf16_partials" in message, message


def test_option_defaults_off_and_copies() -> None:
    import ep_backend

    assert ep_backend.Options().low_latency_combine_bf16_partials is False
    on = ep_backend.Options(low_latency_combine_bf16_partials=True)
    assert copy.deepcopy(on).low_latency_combine_bf16_partials is True
    assert "low_latency_combine_bf16_partials=True" in repr(on)
