"""Autograd through the MoE collectives on 2 CPU ranks (dispatch and combine are adjoints).

* ``torch.autograd.gradcheck`` in float64 of dispatch -> row-wise experts -> combine w.r.t.
  ``x`` (and of a cached dispatch in the same graph), with exact sizes and with
  ``num_worst_tokens``. Every rank runs gradcheck on inputs of the same shapes, so all ranks
  issue the same sequence of collectives. Row-wise experts make each rank's output depend on its
  own inputs only, so the Jacobian gradcheck sees on one rank is the true one.
* gradcheck of combine w.r.t. its ``x`` and ``bias``: here the output of one rank depends on the
  rows the others hold, so one rank at a time is "active" while its peers run the same calls on
  constants (their outputs are multiplied by 0, so they feed no gradient into the exchange).
* The ``topk_weights`` path (float32, through dispatch's ``recv_topk_weights`` and combine's
  ``topk_weights``): the autograd gradient equals an analytic dense expectation and central
  finite differences taken one element at a time, in lock step on all ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed
from moe_helpers import Mismatches, format_failures, make_generator, single_thread

WORLD = 2
TIMEOUT = 120.0


def expert_scales(num_experts: int, hidden: int) -> torch.Tensor:
    """The (constant) parameters of every global expert, the same on all ranks: ``[E, H]``."""
    return torch.rand((num_experts, hidden), generator=make_generator(4242), dtype=torch.float64)


def run_experts(recv_x, recv_idx, recv_w, scales_local):
    """Row-wise experts: ``y[n] = sum_le c[n, le] * tanh(recv_x[n] * a_le)``.

    ``c[n, le]`` is the received weight of the slot selecting local expert ``le`` (1 without
    weights). Each row depends only on itself, its routing and its weights.
    """
    y = torch.zeros_like(recv_x)
    for le in range(scales_local.shape[0]):
        mask = (recv_idx == le).to(recv_x.dtype)
        coef = (mask * recv_w.to(recv_x.dtype)).sum(1) if recv_w is not None else mask.sum(1)
        y = y + coef.unsqueeze(1) * torch.tanh(recv_x * scales_local[le])
    return y


def _inputs(rank: int, num_tokens: int, hidden: int, topk: int, num_experts: int, seed: int):
    gen = make_generator(seed, rank)
    x = torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float64)
    scores = torch.rand((num_tokens, num_experts), generator=gen)
    idx = scores.topk(topk, dim=1).indices
    idx = torch.where(torch.rand((num_tokens, topk), generator=gen) < 0.25, -1, idx)
    if num_tokens > 2:
        idx[1] = -1  # a token that goes nowhere
    weights = torch.rand((num_tokens, topk), generator=gen) + 0.5
    return x, idx, weights


# --------------------------------------------------------------------------------------------
# gradcheck: dispatch -> experts -> combine, w.r.t. x
# --------------------------------------------------------------------------------------------


def _gradcheck_moe_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep

    single_thread()
    m = Mismatches()
    num_tokens, hidden, topk, experts_per_rank = 4, 4, 2, 2
    num_experts = experts_per_rank * world
    scales = expert_scales(num_experts, hidden)
    local = scales[rank * experts_per_rank : (rank + 1) * experts_per_rank]
    x, idx, weights = _inputs(rank, num_tokens, hidden, topk, num_experts, seed=1)
    x2 = torch.randn((num_tokens, 2), generator=make_generator(2, rank), dtype=torch.float64)

    for worst in (0, num_tokens * world):

        def moe(x_in, x2_in, worst=worst):
            out = ep.dispatch(x_in, idx, weights, num_experts, num_worst_tokens=worst)
            y = run_experts(out.recv_x, out.recv_topk_idx, out.recv_topk_weights, local)
            cached = ep.dispatch(x2_in, handle=out.handle)  # the same routing, other rows
            y = y + (cached.recv_x**2).sum(1, keepdim=True)
            return ep.combine(y.contiguous(), out.handle).combined_x

        inputs = (x.clone().requires_grad_(), x2.clone().requires_grad_())
        m.context = f"gradcheck dispatch/experts/combine, num_worst_tokens={worst}"
        try:
            ok = torch.autograd.gradcheck(moe, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
            m.check(ok, "gradcheck returned False")
        except Exception as exc:  # a GradcheckError: the same calls ran, the ranks stay in step
            m.fail(f"{type(exc).__name__}: {exc}"[:2000])
    return m.items


def test_gradcheck_dispatch_experts_combine() -> None:
    results = run_distributed(_gradcheck_moe_worker, WORLD, backend="ep", timeout=TIMEOUT)
    assert not any(results), format_failures(results)


# --------------------------------------------------------------------------------------------
# gradcheck: combine w.r.t. its x and bias (one active rank at a time)
# --------------------------------------------------------------------------------------------


def _gradcheck_combine_worker(rank: int, world: int) -> list[str]:
    import ep_backend as ep

    single_thread()
    m = Mismatches()
    num_tokens, hidden, topk = 3, 2, 2
    num_experts = 2 * world
    x, idx, _ = _inputs(rank, num_tokens, hidden, topk, num_experts, seed=3)
    capacity = num_tokens * world  # the same received rows on every rank
    handle = ep.dispatch(x, idx, None, num_experts, num_worst_tokens=capacity).handle
    gen = make_generator(5, rank)
    rows = torch.randn((capacity, hidden), generator=gen, dtype=torch.float64)
    bias = torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float64)
    bias2 = torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float64)

    for active in range(world):

        def combine(rows_in, bias_in, active=active):
            if rank == active:
                return ep.combine(rows_in, handle, bias=(bias_in, bias2)).combined_x
            # Passive: the same calls on constants (perturbing the inputs changes nothing),
            # and a zero output, so that no gradient enters the exchange from this rank.
            rows_c = rows + 0.0 * rows_in
            bias_c = bias + 0.0 * bias_in
            return 0.0 * ep.combine(rows_c, handle, bias=(bias_c, bias2)).combined_x

        inputs = (rows.clone().requires_grad_(), bias.clone().requires_grad_())
        m.context = f"gradcheck combine, active rank {active}"
        try:
            ok = torch.autograd.gradcheck(combine, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
            m.check(ok, "gradcheck returned False")
        except Exception as exc:
            m.fail(f"{type(exc).__name__}: {exc}"[:2000])

    # The same gradients, checked directly: d(sum(combined * G))/d rows[n] = G[src token of n]
    # on the row's source rank, and /d bias = G.
    m.context = "combine gradients"
    rows_in = rows.clone().requires_grad_()
    bias_in = bias.clone().requires_grad_()
    weight = torch.randn((num_tokens, hidden), generator=gen, dtype=torch.float64)
    combined = ep.combine(rows_in, handle, bias=bias_in).combined_x
    (combined * weight).sum().backward()
    all_weights = [torch.empty_like(weight) for _ in range(world)]
    dist.all_gather(all_weights, weight)
    expected = torch.zeros_like(rows)
    for n in range(capacity):
        src_rank, src_idx = int(handle.recv_src_rank[n]), int(handle.recv_src_idx[n])
        if src_rank >= 0:
            expected[n] = all_weights[src_rank][src_idx]
    m.check(torch.equal(rows_in.grad, expected), "grad of combine x")
    m.check(torch.equal(bias_in.grad, weight), "grad of bias")
    return m.items


def test_gradcheck_combine_x_and_bias() -> None:
    results = run_distributed(_gradcheck_combine_worker, WORLD, backend="ep", timeout=TIMEOUT)
    assert not any(results), format_failures(results)


# --------------------------------------------------------------------------------------------
# topk_weights: autograd vs analytic expectation vs finite differences
# --------------------------------------------------------------------------------------------


def _weights_grad_worker(rank: int, world: int, worst: int, given_layout: bool) -> list[str]:
    import ep_backend as ep

    single_thread()
    m = Mismatches(context=f"topk_weights gradient, num_worst_tokens={worst}")
    sizes = [3, 2, 4, 1][:world]  # T differs per rank: no gradcheck here, our own lock step
    hidden, topk, experts_per_rank = 6, 3, 2
    num_experts = experts_per_rank * world
    scales = expert_scales(num_experts, hidden)
    local = scales[rank * experts_per_rank : (rank + 1) * experts_per_rank]
    inputs = [_inputs(r, sizes[r], hidden, topk, num_experts, seed=7) for r in range(world)]
    x, idx, weights = inputs[rank]
    gen = make_generator(8, rank)
    g_x = torch.randn((sizes[rank], hidden), generator=gen, dtype=torch.float64)
    g_w = torch.randn((sizes[rank], topk), generator=gen, dtype=torch.float64)

    # dispatch(layout=) keeps the same gradients (its handle holds the layout's tensors).
    given = {"layout": ep.get_dispatch_layout(idx, num_experts)} if given_layout else {}

    def local_loss(x_in, w_in):
        out = ep.dispatch(x_in, idx, w_in, num_experts, num_worst_tokens=worst, **given)
        y = run_experts(out.recv_x, out.recv_topk_idx, out.recv_topk_weights, local)
        c = ep.combine(y, out.handle, topk_weights=out.recv_topk_weights)
        return (c.combined_x * g_x).sum() + (c.combined_topk_weights.double() * g_w).sum()

    # Autograd: every rank's backward takes part in every other rank's gradient.
    x_in, w_in = x.clone().requires_grad_(), weights.clone().requires_grad_()
    local_loss(x_in, w_in).backward()
    m.check(w_in.grad is not None and w_in.grad.dtype == torch.float32, "w.grad float32")

    # Analytic: loss = sum_t sum_k [e >= 0] (w[t,k] <g_x[t], tanh(x[t] * a_e)> + g_w[t,k] w[t,k]).
    valid = idx >= 0
    act = torch.tanh(x.unsqueeze(1) * scales[idx.clamp(min=0)])  # [T, K, H]
    expected_w = torch.where(valid, (act * g_x.unsqueeze(1)).sum(2) + g_w, 0.0)
    m.check(
        torch.allclose(w_in.grad.double(), expected_w, rtol=1e-6, atol=1e-6),
        f"w.grad {w_in.grad} != analytic {expected_w}",
    )
    deriv = scales[idx.clamp(min=0)] * (1 - act**2)  # d tanh(x a) / dx
    coef = torch.where(valid, weights.double(), 0.0).unsqueeze(2)
    expected_x = (coef * deriv * g_x.unsqueeze(1)).sum(1)
    m.check(torch.allclose(x_in.grad, expected_x, rtol=1e-12, atol=1e-12), "x.grad analytic")
    m.check(bool((w_in.grad[~valid] == 0).all()), "no gradient for -1 slots")

    # Central finite differences, one element of one rank at a time, all ranks in lock step.
    numeric = torch.zeros((sizes[rank], topk), dtype=torch.float64)
    eps = 1e-2
    for owner in range(world):
        for t in range(sizes[owner]):
            for k in range(topk):
                values = []
                for sign in (1.0, -1.0):
                    w_pert = weights.clone()
                    if rank == owner:
                        w_pert[t, k] += sign * eps
                    with torch.no_grad():
                        total = local_loss(x, w_pert).reshape(1)
                    dist.all_reduce(total)
                    values.append((float(total), float(w_pert[t, k]) if rank == owner else 0))
                if rank == owner:
                    (plus, w_plus), (minus, w_minus) = values
                    numeric[t, k] = (plus - minus) / (w_plus - w_minus)
    m.check(
        torch.allclose(w_in.grad.double(), numeric, rtol=1e-5, atol=1e-6),
        f"w.grad {w_in.grad} != finite differences {numeric}",
    )
    return m.items


@pytest.mark.parametrize(("worst", "given_layout"), [(0, False), (16, False), (0, True)])
def test_topk_weights_gradient(worst: int, given_layout: bool) -> None:
    results = run_distributed(
        _weights_grad_worker, WORLD, worst, given_layout, backend="ep", timeout=TIMEOUT
    )
    assert not any(results), format_failures(results)


def _combine_backward_odd_hidden(rank: int, world: int) -> list[bool]:
    import ep_backend as ep

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 2, dtype=torch.float64, generator=g)  # 16-byte rows for the dispatch
    idx = torch.randint(-1, 4, (6, 2), generator=g)
    out = ep.dispatch(x, idx, None, 4)
    # combine rows of 3 float64 (24 bytes): its backward must still reach every row
    y = torch.randn(out.recv_x.shape[0], 3, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.arange(1.0, 4.0, dtype=torch.float64)
    (ep.combine(y, out.handle).combined_x * weights).sum().backward()
    return [y.grad.shape == y.shape, bool(torch.equal(y.grad, weights.expand_as(y)))]


def test_combine_backward_with_rows_not_a_multiple_of_16_bytes() -> None:
    for rank, ok in enumerate(run_distributed(_combine_backward_odd_hidden, 2, backend="ep")):
        assert all(ok), (rank, ok)
