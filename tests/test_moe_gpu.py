"""The MoE collectives on CUDA tensors equal the reference bitwise (low-latency combine: within
float32-accumulation tolerance, and bitwise deterministic).

The high-throughput ops run on ``gpu_world_size()`` ranks: one per GPU, at least 2 (2 ranks may
share one GPU: the NVLink path then runs over CUDA IPC within the device); the reference runs on
CPU copies over Gloo, so no NCCL communicator is needed. The low-latency ops need one GPU per rank
(NCCL). Cases named ``one-rank`` run a group of one rank, on one GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist_utils import gpu_world_size, run_distributed
from moe_helpers import cuda_routing, ll_combine_beyond_tolerance, ll_valid_mask, nvshmem_built


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def _checker(failures: list[str]):
    def check(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        a, b = _cpu(a), _cpu(b)
        if a is None or b is None:
            if a is not b:
                failures.append(f"{name}: one side is None")
            return
        if a.dtype != b.dtype or a.shape != b.shape:
            failures.append(f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                             b.view(torch.uint8) if b.element_size() == 1 else b):  # fmt: skip
            failures.append(f"{name}: values differ")

    return check


def _moe_cuda(rank: int, world: int, hidden: int, topk: int, num_experts: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    dev = torch.device("cuda", torch.cuda.current_device())
    failures: list[str] = []
    check = _checker(failures)

    num_tokens = [300, 0, 257, 64][rank % 4]
    x, idx, w = cuda_routing(num_tokens, hidden, num_experts, topk, 1000 + rank, distinct=False)
    g = torch.Generator(device=dev).manual_seed(3000 + rank)  # for the FP8 input below
    xc, idxc, wc = x.cpu(), idx.cpu(), w.cpu()
    for ids, ids_cpu in ((idx, idxc), (idx.int(), idxc.int())):  # the layout kernel, both dtypes
        got, want = (
            ep.get_dispatch_layout(ids, num_experts),
            ref.get_dispatch_layout(ids_cpu, num_experts, world),
        )
        check(f"layout per_rank {ids.dtype}", got.num_tokens_per_rank, want.num_tokens_per_rank)
        check(
            f"layout per_expert {ids.dtype}", got.num_tokens_per_expert, want.num_tokens_per_expert
        )
        check(f"layout in_rank {ids.dtype}", got.is_token_in_rank, want.is_token_in_rank)
        check(f"layout send_pos {ids.dtype}", got.send_pos, want.send_pos)
    # More than 1,024 tokens: one layout block per 1,024, each adding up the counts before it.
    _, big, _ = cuda_routing([2500, 1025, 4096, 3000][rank % 4], 16, num_experts, topk, 4000 + rank)
    got_big, want_big = (
        ep.get_dispatch_layout(big, num_experts),
        ref.get_dispatch_layout(big.cpu(), num_experts, world),
    )
    check("layout per_rank, many blocks", got_big.num_tokens_per_rank, want_big.num_tokens_per_rank)
    check(
        "layout per_expert, many blocks",
        got_big.num_tokens_per_expert,
        want_big.num_tokens_per_expert,
    )
    check("layout in_rank, many blocks", got_big.is_token_in_rank, want_big.is_token_in_rank)
    check("layout send_pos, many blocks", got_big.send_pos, want_big.send_pos)
    bad = idx.clone()
    if num_tokens > 0:  # an id out of range: counted as -1, the next call on the device raises
        bad[0, 0] = num_experts
        ep.get_dispatch_layout(bad, num_experts)
        torch.cuda.synchronize()  # the error record is read by the first call after the kernel ran
        try:
            ep.get_dispatch_layout(idx, num_experts)
            failures.append("an out-of-range id in get_dispatch_layout was never reported")
        except RuntimeError as exc:
            if f"got topk_idx value {num_experts}" not in str(exc):
                failures.append(f"layout error message: {exc}")
        again = ep.get_dispatch_layout(idx, num_experts)  # reported once; then fine again
        check("layout after the error", again.is_token_in_rank, want.is_token_in_rank)
    for kwargs in ({}, {"expert_alignment": 4}, {"num_worst_tokens": 2048}, {"layout": 1},
                   {"layout": 1, "num_worst_tokens": 2048, "expert_alignment": 8}):  # fmt: skip
        b = ref.dispatch(xc, idxc, wc, num_experts,
                         **{k: v for k, v in kwargs.items() if k != "layout"})  # fmt: skip
        if "layout" in kwargs:  # the layout from get_dispatch_layout, passed in
            kwargs = {**kwargs, "layout": ep.get_dispatch_layout(idx, num_experts)}
        a = ep.dispatch(x, idx, w, num_experts, **kwargs)
        if "layout" in kwargs and "num_worst_tokens" not in kwargs:
            # Editing the layout afterwards must not reach combine or cached dispatch (they
            # recompute the routing from the handle then).
            kwargs["layout"].send_pos.fill_(12345)
        kwargs = {k: ("given" if k == "layout" else v) for k, v in kwargs.items()}
        check(f"is_token_in_rank {kwargs}", a.handle.is_token_in_rank, b.handle.is_token_in_rank)
        check(f"num_tokens_per_rank {kwargs}", a.handle.num_tokens_per_rank,
              b.handle.num_tokens_per_rank)  # fmt: skip
        check(f"recv_x {kwargs}", a.recv_x[: b.handle.recv_src_idx.ge(0).sum()],
              b.recv_x[: b.handle.recv_src_idx.ge(0).sum()])  # fmt: skip
        check(f"recv_topk_idx {kwargs}", a.recv_topk_idx, b.recv_topk_idx)
        check(f"recv_topk_weights {kwargs}", a.recv_topk_weights, b.recv_topk_weights)
        check(f"per_expert {kwargs}", a.num_recv_tokens_per_expert, b.num_recv_tokens_per_expert)
        if a.num_recv_tokens_per_expert_list != b.num_recv_tokens_per_expert_list:
            failures.append(f"per_expert_list {kwargs}: {a.num_recv_tokens_per_expert_list[:8]}")
        check(f"src_idx {kwargs}", a.handle.recv_src_idx, b.handle.recv_src_idx)
        y = (a.recv_x.float() * 0.75).bfloat16()
        c = ep.combine(y, a.handle, a.recv_topk_weights)
        d = ref.combine(y.cpu(), b.handle, b.recv_topk_weights)
        check(f"combined_x {kwargs}", c.combined_x, d.combined_x)
        check(f"combined_w {kwargs}", c.combined_topk_weights, d.combined_topk_weights)
        a2 = ep.dispatch(x * 3, handle=a.handle)
        b2 = ref.dispatch(xc * 3, handle=b.handle)
        n = int(b.handle.recv_src_idx.ge(0).sum())
        check(f"cached {kwargs}", a2.recv_x[:n], b2.recv_x[:n])
    # Special values through the combine reduction (NaN, infinities, signed zeros, subnormals,
    # overflow to infinity, rounding ties): the reference's bytes wherever it is not NaN.
    a = ep.dispatch(x, idx, w, num_experts)
    b = ref.dispatch(xc, idxc, wc, num_experts)
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-39, 3.3895e38,
         -3.3895e38, 1.0, 1.0078125, 2.0 ** -8, 3.0, -1e-3],
    )  # fmt: skip
    pick = torch.randint(
        0, len(specials), tuple(a.recv_x.shape), generator=torch.Generator().manual_seed(77 + rank)
    )
    y = specials[pick].bfloat16()
    got = ep.combine(y.to(dev), a.handle).combined_x.cpu()
    want = ref.combine(y, b.handle).combined_x
    nan = want.isnan()  # NaN where the reference has NaN; its payload is not specified
    if not torch.equal(got.isnan(), nan):
        failures.append("combined_x, special values: NaN in other places")
    elif not torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]):
        failures.append("combined_x, special values: values differ")
    if want.numel() > 0 and not (nan.any() and want.isinf().any() and (want == 0).any()):
        failures.append("combined_x, special values: the input produced no NaN, inf or zero")
    # Float16 combine runs the kernels too (in-type pair sums on 2 ranks, float32 otherwise):
    # random rows with weights, two biases, and the special values of FP16 (subnormals, the
    # largest finite, sums that overflow, ties), bitwise wherever the reference is not NaN.
    y16 = (a.recv_x.float() * 0.75).half()
    bias = [torch.randn(num_tokens, hidden, device=dev, generator=g).half() for _ in range(2)]
    for name, kwargs, ref_kwargs in (
        ("", {}, {}),
        (", two biases", {"bias": tuple(bias)}, {"bias": tuple(t.cpu() for t in bias)}),
    ):
        c = ep.combine(y16, a.handle, a.recv_topk_weights, **kwargs)
        d = ref.combine(y16.cpu(), b.handle, b.recv_topk_weights, **ref_kwargs)
        check(f"float16 combined_x{name}", c.combined_x, d.combined_x)
        check(f"float16 combined_w{name}", c.combined_topk_weights, d.combined_topk_weights)
    specials16 = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 2.0**-24, -(2.0**-23), 6.1e-5,
         65504.0, -65504.0, 1.0, 1.0 + 2.0**-10, 2.0**-11, 3.0, -1e-3, 40000.0],
        dtype=torch.float16,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(9 + rank)
    y16 = specials16[torch.randint(0, len(specials16), tuple(a.recv_x.shape), generator=gen)]
    bias16 = specials16[torch.randint(0, len(specials16), (num_tokens, hidden), generator=gen)]
    for name, kwargs, ref_kwargs in (
        ("", {}, {}),
        (", bias", {"bias": bias16.to(dev)}, {"bias": bias16}),
    ):
        got = ep.combine(y16.to(dev), a.handle, **kwargs).combined_x.cpu()
        want = ref.combine(y16, b.handle, **ref_kwargs).combined_x
        nan = want.isnan()
        if not torch.equal(got.isnan(), nan):
            failures.append(f"float16 combined_x, special values{name}: NaN in other places")
        elif not torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]):
            failures.append(f"float16 combined_x, special values{name}: values differ")
    # async_op: the comm stream and a Work to wait on; the per-expert list needs no device read.
    a = ep.dispatch(x, idx, w, num_experts, async_op=True)
    a.work.wait()
    b = ref.dispatch(xc, idxc, wc, num_experts)
    check("async recv_x", a.recv_x, b.recv_x)
    if a.num_recv_tokens_per_expert_list != b.num_recv_tokens_per_expert_list:
        failures.append(f"async per_expert_list: {a.num_recv_tokens_per_expert_list[:8]}")
    c = ep.combine(a.recv_x, a.handle, async_op=True)
    c.work.wait()
    check("async combined_x", c.combined_x, ref.combine(b.recv_x, b.handle).combined_x)
    x8, s8 = ref.quantize_fp8_per128(torch.randn(num_tokens, 256, device=dev, generator=g))
    b = ref.dispatch(x8.cpu(), idxc, None, num_experts, x_scales=s8.cpu())
    a = ep.dispatch(x8, idx, None, num_experts, x_scales=s8)
    check("fp8 recv_x", a.recv_x, b.recv_x)
    check("fp8 scales", a.recv_x_scales, b.recv_x_scales)
    idx32 = idx.int()
    a = ep.dispatch(x8, idx32, None, num_experts, x_scales=s8,
                    layout=ep.get_dispatch_layout(idx32, num_experts))  # fmt: skip
    check("fp8 recv_x, int32 ids, given layout", a.recv_x, b.recv_x)
    check("fp8 scales, int32 ids, given layout", a.recv_x_scales, b.recv_x_scales)
    torch.cuda.synchronize()
    return failures


# A group of one rank (expert parallelism of 1 beside TP / DP) runs the same kernels: its
# dispatch and combine are local permutations and sums, its low-latency ops NVSHMEM with one PE.
ONE_RANK = pytest.param(True, id="one-rank", marks=pytest.mark.gpu(min_gpus=1))


def _world(one_rank: bool) -> int:
    return 1 if one_rank else gpu_world_size()


@pytest.mark.parametrize("one_rank", [pytest.param(False, id="ranks"), ONE_RANK])
@pytest.mark.parametrize(
    ("hidden", "topk", "num_experts"), [(7168, 8, 256), (200, 1, 4), (512, 32, 64)]
)
@pytest.mark.gpu(min_gpus=1)
def test_moe_collectives_on_cuda_match_reference(
    hidden: int, topk: int, num_experts: int, one_rank: bool
) -> None:
    world = _world(one_rank)
    num_experts = -(-num_experts // world) * world  # a multiple of the rank count
    for rank, failures in enumerate(
        run_distributed(_moe_cuda, world, hidden, topk, num_experts, backend="ep")
    ):
        assert failures == [], (rank, failures)


def _independent(name: str, tensors: dict[str, torch.Tensor], failures: list[str]) -> None:
    """The small outputs of one call share one allocation (native/backend/carved_tensors.hpp):
    each must still be a tensor of its own, over memory of its own, with its own version."""
    items = [(k, t) for k, t in tensors.items() if t.numel() > 0]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k) for k, t in items)
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            failures.append(f"{name}: {a} and {b} overlap in memory")
    for k, t in items:
        if t._base is not None:
            failures.append(f"{name}: {k} is a view")
        before = {j: u._version for j, u in items}
        t.copy_(t.clone())  # an in-place write bumps this tensor's version, and no other's
        for j, u in items:
            if u._version != before[j] + (j == k):
                failures.append(f"{name}: writing {k} in place changed the version of {j}")


def _separate_outputs(rank: int, world: int, with_low_latency: bool) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    failures: list[str] = []
    check = _checker(failures)
    num_experts, hidden = 8 * world, 512
    num_tokens = [96, 128, 80, 112][rank % 4]  # at most the low-latency M = 128
    x, idx, w = cuda_routing(num_tokens, hidden, num_experts, 4, 5000 + rank, distinct=False)
    probe = ep.get_dispatch_layout(idx, num_experts)  # a dispatch refuses it once written
    _independent("layout", {"per_rank": probe.num_tokens_per_rank,
                            "per_expert": probe.num_tokens_per_expert,
                            "in_rank": probe.is_token_in_rank, "send_pos": probe.send_pos},
                 failures)  # fmt: skip
    lay = ep.get_dispatch_layout(idx, num_experts)
    for given in (True, False):
        d = ep.dispatch(x, idx, w, num_experts, layout=lay if given else None)
        h = d.handle
        _independent(f"dispatch (layout given: {given})",
                     {"per_expert": d.num_recv_tokens_per_expert,
                      "recv_per_rank": h.num_recv_tokens_per_rank,
                      **({} if given else {"in_rank": h.is_token_in_rank,
                                           "per_rank": h.num_tokens_per_rank})},
                     failures)  # fmt: skip
        # the handle still serves after those in-place writes
        y = (d.recv_x.float() * 0.5).bfloat16()
        want = ref.combine(y.cpu(), ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), num_experts).handle)
        check(f"combine after in-place writes (layout given: {given})",
              ep.combine(y, h).combined_x, want.combined_x)  # fmt: skip
    if with_low_latency:
        la = ep.low_latency_dispatch(x, idx, 128, num_experts, use_fp8=True)
        y = torch.randn(la.recv_x.shape, device=x.device).bfloat16()
        first = ep.low_latency_combine(y, idx, w, la.handle)
        lb = ep.low_latency_dispatch(x, idx, 128, num_experts, use_fp8=True)
        _independent("low_latency_dispatch", {"scales": lb.recv_x_scales,
                                              "count": lb.recv_count,
                                              "src_info": lb.handle.src_info},
                     failures)  # fmt: skip
        # layout_range (by whose identity and version the kernels find the dispatch's buffer)
        # kept its version: the kernel combine runs, bitwise as for the untouched handle
        check("ll combine after in-place writes", ep.low_latency_combine(y, idx, w, lb.handle),
              first)  # fmt: skip
    torch.cuda.synchronize()
    return failures


@pytest.mark.parametrize("one_rank", [pytest.param(False, id="ranks"), ONE_RANK])
@pytest.mark.gpu(min_gpus=1)
def test_small_outputs_are_separate_tensors(one_rank: bool) -> None:
    world = _world(one_rank)
    # the low-latency ops need one GPU per rank; the high-throughput ones may share one
    with_low_latency = nvshmem_built() and torch.cuda.device_count() >= world
    for rank, failures in enumerate(
        run_distributed(_separate_outputs, world, with_low_latency, backend="ep")
    ):
        assert failures == [], (rank, failures)


def _ll_cuda(rank: int, world: int, hidden: int, topk: int, num_experts: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    dev = torch.device("cuda", torch.cuda.current_device())
    failures: list[str] = []
    check = _checker(failures)
    num_tokens = [128, 0, 77, 64][rank % 4]
    x, idx, w = cuda_routing(num_tokens, hidden, num_experts, topk, 2000 + rank, distinct=False)
    g = torch.Generator(device=dev).manual_seed(4000 + rank)  # for the combine input below
    xl, il, ll_tokens = x, idx, num_tokens
    for fp8, rs, ue in ((False, False, False), (True, False, False), (True, True, True)):
        la = ep.low_latency_dispatch(xl, il, 128, num_experts, use_fp8=fp8, round_scale=rs,
                                     use_ue8m0=ue)  # fmt: skip
        lb = ref.low_latency_dispatch(xl, il, 128, num_experts, use_fp8=fp8, round_scale=rs,
                                      use_ue8m0=ue)  # fmt: skip
        for le in range(la.recv_count.numel()):
            n = int(lb.recv_count[le])
            check(f"ll recv_x {fp8}{rs}{ue} e{le}", la.recv_x[le, :n], lb.recv_x[le, :n])
            if fp8:
                check(f"ll scales e{le}", la.recv_x_scales[le, :n], lb.recv_x_scales[le, :n])
        check("ll count", la.recv_count, lb.recv_count)
        check("ll layout", la.handle.layout_range, lb.handle.layout_range)
    failures += (
        []
        if not nvshmem_built() or (ep.get_backend().low_latency_transport == "nvshmem")
        else [f"low-latency ops did not use NVSHMEM: {ep.get_backend().low_latency_transport}"]
    )
    yl = torch.randn(lb.recv_x.shape, device=dev, generator=g).bfloat16()
    out_a = ep.low_latency_combine(yl, il, w[:ll_tokens], la.handle)
    out_b = ref.low_latency_combine(yl, il, w[:ll_tokens], lb.handle)
    magnitude = ref.low_latency_combine(yl.abs(), il, w[:ll_tokens].abs(), lb.handle)
    # zero copy: outputs written straight into the send buffer of a fresh dispatch; the kernel
    # is deterministic, so bitwise the same as out_a
    lz = ep.low_latency_dispatch(xl, il, 128, num_experts, use_fp8=False)
    buf = ep.get_low_latency_combine_buffer(lz.handle)
    buf.copy_(yl)
    check("zero-copy combine", ep.low_latency_combine(buf, il, w[:ll_tokens], lz.handle), out_a)
    # a second combine of a handle: its kernel state is spent, the ATen path (k order) runs
    second = ep.low_latency_combine(yl, il, w[:ll_tokens], lz.handle)
    for name, got in (("ll combine", out_a), ("second combine", second)):
        bad = ll_combine_beyond_tolerance(got, out_b, magnitude, topk)
        if bad:
            failures.append(f"{name}: {bad} outputs beyond float32-accumulation tolerance")
    # hook mode: two dispatches in flight (both buffers), received later, in order
    x2 = (xl.float() * -1.5).bfloat16()
    h1 = ep.low_latency_dispatch(xl, il, 128, num_experts, use_fp8=False, return_recv_hook=True)
    h2 = ep.low_latency_dispatch(x2, il, 128, num_experts, use_fp8=False, return_recv_hook=True)
    try:  # a third would reuse a buffer still awaiting its receive
        ep.low_latency_dispatch(xl, il, 128, num_experts, use_fp8=False, return_recv_hook=True)
        third = "no error"
    except RuntimeError as exc:
        third = str(exc)
    h1.hook()
    h2.hook()
    for name, h, xin in (("hook 1", h1, xl), ("hook 2", h2, x2)):
        e = ref.low_latency_dispatch(xin, il, 128, num_experts, use_fp8=False)
        check(f"{name} count", h.recv_count, e.recv_count)
        for le in range(h.recv_count.numel()):
            n = int(e.recv_count[le])
            check(f"{name} recv_x e{le}", h.recv_x[le, :n], e.recv_x[le, :n])
    if ep.get_backend().low_latency_transport == "nvshmem" and "await their recv hook" not in third:
        failures.append(f"third pending dispatch: {third}")
    torch.cuda.synchronize()
    return failures


# One GPU per rank (NCCL refuses two ranks on one GPU), except for a group of one rank.
LL_WORLDS = [pytest.param(False, id="ranks", marks=pytest.mark.gpu(min_gpus=2)), ONE_RANK]


@pytest.mark.parametrize("one_rank", LL_WORLDS)
@pytest.mark.parametrize(("hidden", "topk", "num_experts"), [(7168, 8, 256), (512, 32, 64)])
def test_low_latency_on_cuda_match_reference(
    hidden: int, topk: int, num_experts: int, one_rank: bool
) -> None:
    world = _world(one_rank)
    for rank, failures in enumerate(
        run_distributed(_ll_cuda, world, hidden, topk, num_experts, backend="ep")
    ):
        assert failures == [], (rank, failures)


def _ll_bf16_partials(rank: int, world: int) -> list[str]:
    import ep_backend as ep
    from ep_backend import reference as ref

    dev = torch.device("cuda", torch.cuda.current_device())
    failures: list[str] = []
    check = _checker(failures)
    hidden, topk, num_experts = 7168, 8, 32
    num_tokens = [128, 77, 0, 64][rank % 4]
    x, idx, w = cuda_routing(num_tokens, hidden, num_experts, topk, 6000 + rank)
    g = torch.Generator(device=dev).manual_seed(7000 + rank)
    want = ref.low_latency_dispatch(x, idx, 128, num_experts, use_fp8=False)
    y = torch.randn(want.recv_x.shape, device=dev, generator=g).bfloat16()
    options = ep.get_backend().options
    for partials in (torch.float32, torch.bfloat16):
        expected = ref.low_latency_combine(y, idx, w, want.handle, per_rank_partials=partials)
        options.low_latency_combine_bf16_partials = partials == torch.bfloat16
        d = ep.low_latency_dispatch(x, idx, 128, num_experts, use_fp8=False)
        check(f"kernel combine, {partials} partials", ep.low_latency_combine(y, idx, w, d.handle),
              expected)  # fmt: skip
        transport = ep.get_backend().low_latency_transport
        if nvshmem_built() and transport != "nvshmem":
            failures.append(f"the combine ran on {transport!r}, not the NVSHMEM kernels")
        if partials == torch.bfloat16:
            # the handle's kernel state is spent: the ATen path runs, with the model's bits too
            check("second combine (ATen path), BF16 partials",
                  ep.low_latency_combine(y, idx, w, d.handle), expected)  # fmt: skip
    options.low_latency_combine_bf16_partials = False
    torch.cuda.synchronize()
    return failures


@pytest.mark.parametrize("one_rank", LL_WORLDS)
def test_low_latency_bf16_partials_match_reference(one_rank: bool) -> None:
    """The kernels' combine, bit for bit the reference's model of it: float32 partials (the
    default) and ``Options.low_latency_combine_bf16_partials``. At one rank each token has one
    partial, so both give the same bits: that run checks the BF16 partial's store and load."""
    world = _world(one_rank)
    for rank, failures in enumerate(run_distributed(_ll_bf16_partials, world, backend="ep")):
        assert failures == [], (rank, failures)


def _ll_graph_replay(rank: int, world: int, hidden: int, topk: int, num_experts: int) -> dict:
    """Low-latency dispatch + combine captured once, replayed 100x with new data.

    Dispatch exact; combine within float32-accumulation tolerance of the reference and, replayed
    again with the first step's inputs at the end, bitwise the same as the first time.
    """
    import ep_backend as ep
    from ep_backend import reference as ref

    m = 128
    failures: list[str] = []
    check = _checker(failures)

    def inputs(step: int):
        return cuda_routing(m, hidden, num_experts, topk, seed=step * 31 + rank)

    x, idx, w = inputs(0)
    sx, sidx, sw = x.clone(), idx.clone(), w.clone()
    for _ in range(2):  # warm-up outside capture: creates the NVSHMEM runtime at its size
        d = ep.low_latency_dispatch(sx, sidx, m, num_experts, use_fp8=False)
        ep.low_latency_combine(d.recv_x, sidx, sw, d.handle)
    transport = ep.get_backend().low_latency_transport
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d = ep.low_latency_dispatch(sx, sidx, m, num_experts, use_fp8=False)
        y = d.recv_x * 2
        out = ep.low_latency_combine(y, sidx, sw, d.handle)
    for step in range(1, 101):
        x, idx, w = inputs(step)
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        graph.replay()
        e = ref.low_latency_dispatch(x.cpu(), idx.cpu(), m, num_experts, use_fp8=False)
        check(f"step {step} recv_count", d.recv_count, e.recv_count)
        # Slots past recv_count are unspecified; the valid ones in one copy to the host (one
        # per expert made the one-rank run, 256 local experts, a GPU sync per slice).
        valid = ll_valid_mask(e.recv_count, e.recv_x.shape[1])
        check(f"step {step} recv_x (valid slots)", d.recv_x.cpu()[valid], e.recv_x[valid])
        want = ref.low_latency_combine(e.recv_x * 2, idx.cpu(), w.cpu(), e.handle)
        magnitude = ref.low_latency_combine(
            (e.recv_x * 2).abs(), idx.cpu(), w.cpu().abs(), e.handle
        )
        bad = ll_combine_beyond_tolerance(out, want, magnitude, topk)
        if bad:
            failures.append(f"step {step} combine: {bad} outputs beyond tolerance")
        if step == 1:
            first = out.clone()
        if len(failures) > 5:
            break
    # Another M needs new buffers, which the captured graph would lose: refused on every rank.
    try:
        ep.low_latency_dispatch(sx, sidx, 2 * m, num_experts, use_fp8=False)
        other_m = "no error"
    except RuntimeError as exc:
        other_m = str(exc)
    x, idx, w = inputs(1)
    sx.copy_(x)
    sidx.copy_(idx)
    sw.copy_(w)
    graph.replay()
    check("replay of step 1 again (run-to-run determinism)", out, first)
    return {"transport": transport, "failures": failures, "other_m": other_m}


@pytest.mark.parametrize("one_rank", LL_WORLDS)
def test_low_latency_cuda_graph_replay_with_new_data(one_rank: bool) -> None:
    if not nvshmem_built():
        pytest.skip("libep_nvshmem.so was not built: low-latency ops run on ATen + NCCL")
    world = _world(one_rank)
    for rank, r in enumerate(run_distributed(_ll_graph_replay, world, 7168, 8, 16, backend="ep")):
        assert r["transport"] == "nvshmem", (rank, r["transport"])
        assert r["failures"] == [], (rank, r["failures"])
        assert "a CUDA graph captured earlier" in r["other_m"], (rank, r["other_m"])
