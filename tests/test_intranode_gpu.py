"""The NVLink (intranode) path of dispatch/combine: CUDA graphs, soak, bad input, timeouts.

``gpu_world_size()`` ranks: one per GPU, at least 2 (ranks may share a GPU: CUDA IPC within the
device); tests parametrized with ``one-rank`` also run on a group of one rank. The reference runs
on CPU copies over Gloo.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from _dist_utils import gpu_world_size, run_distributed
from moe_helpers import cuda_routing, nvshmem_built, scale_rows

pytestmark = pytest.mark.gpu(min_gpus=1)

H, K, E = 1024, 8, 64

# Tests parametrized with WORLDS also run on a group of one rank (expert parallelism of 1 beside
# TP / DP), which runs the same kernels: its dispatch is a local permutation into its own slab.
WORLDS = [pytest.param(False, id="ranks"), pytest.param(True, id="one-rank")]


def _world(one_rank: bool) -> int:
    return 1 if one_rank else gpu_world_size()


def _inputs(rank: int, num_tokens: int, seed: int, hidden: int = H, topk: int = K):
    return cuda_routing(num_tokens, hidden, E, topk, seed=seed * 131 + rank)


def _graph_replay(rank: int, world: int, given_layout: bool, steps: int) -> list[str]:
    """Worst-case dispatch + combine captured once, replayed with new data: equal to the spec.
    With ``given_layout`` the graph holds get_dispatch_layout and a dispatch taking its result."""
    import ep_backend as ep
    from ep_backend import reference as ref

    cap = 4096
    x, idx, w = _inputs(rank, 512, seed=0)
    static_x, static_idx, static_w = x.clone(), idx.clone(), w.clone()
    for _ in range(2):  # warm-up outside capture: creates the transport at its final size
        out = ep.dispatch(static_x, static_idx, static_w, E, num_worst_tokens=cap)
        ep.combine(out.recv_x, out.handle, out.recv_topk_weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layout = {"layout": ep.get_dispatch_layout(static_idx, E)} if given_layout else {}
        out = ep.dispatch(static_x, static_idx, static_w, E, num_worst_tokens=cap, **layout)
        y = out.recv_x * 2
        comb = ep.combine(y, out.handle, out.recv_topk_weights)
    failures = []
    for step in range(steps):
        x, idx, w = _inputs(rank, 512, seed=step + 1)
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        expected = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, num_worst_tokens=cap)
        valid = int(expected.handle.recv_src_idx.ge(0).sum())
        if not torch.equal(out.recv_x[:valid].cpu(), expected.recv_x[:valid]):
            failures.append(f"step {step}: recv_x")
        if not torch.equal(out.recv_topk_idx.cpu(), expected.recv_topk_idx):
            failures.append(f"step {step}: recv_topk_idx")
        want = ref.combine(expected.recv_x * 2, expected.handle, expected.recv_topk_weights)
        if not torch.equal(comb.combined_x.cpu(), want.combined_x):
            failures.append(f"step {step}: combined_x")
    return failures


@pytest.mark.parametrize("one_rank", WORLDS)
@pytest.mark.parametrize(
    ("given_layout", "steps"), [(False, 100), (True, 30)], ids=["own-layout", "given-layout"]
)
def test_cuda_graph_capture_and_replay_with_new_data(
    given_layout: bool, steps: int, one_rank: bool
) -> None:
    for rank, failures in enumerate(
        run_distributed(
            _graph_replay, _world(one_rank), given_layout, steps, backend="ep", timeout=400
        )
    ):
        assert failures == [], (rank, failures[:5])


# Row layouts the soak cycles through (hidden, top-k): each call lands rows in buffer regions the
# previous call filled with another layout, so stale bytes sit where this call's rows go.
SOAK_SHAPES = ((H, K), (512, 32), (2048, 4), (256, 1))


def _soak(rank: int, world: int, iterations: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    failures: list[str] = []
    mem = []
    for step in range(iterations):
        # Every 10th step more than 1,024 tokens: the layout kernel then runs one block per
        # 1,024 tokens, which add up each other's counts.
        high = 3100 if step % 10 == 5 else 700
        num_tokens = int(
            torch.randint(0, high, (1,), generator=torch.Generator().manual_seed(step * 7 + rank))
        )
        hidden, topk = SOAK_SHAPES[step % len(SOAK_SHAPES)]
        x, idx, w = _inputs(rank, num_tokens, seed=step, hidden=hidden, topk=topk)
        out = ep.dispatch(x, idx, w, E)
        comb = ep.combine(out.recv_x, out.handle, out.recv_topk_weights)
        again = ep.dispatch(x * 2, handle=out.handle)  # cached: rows without metadata
        if step < 400 or step % 50 == 0:  # early steps: small sequence numbers
            expected = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
            if not torch.equal(out.recv_x.cpu(), expected.recv_x):
                failures.append(f"step {step}: recv_x")
            if not torch.equal(out.recv_topk_idx.cpu(), expected.recv_topk_idx):
                failures.append(f"step {step}: recv_topk_idx")
            want = ref.combine(expected.recv_x, expected.handle, expected.recv_topk_weights)
            if not torch.equal(comb.combined_x.cpu(), want.combined_x):
                failures.append(f"step {step}: combine")
            if not torch.equal(again.recv_x.cpu(), expected.recv_x * 2):
                failures.append(f"step {step}: cached dispatch")
        if step in (iterations // 4, iterations - 1):
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
    return {"failures": failures, "growth": mem[1] - mem[0]}


def test_soak_2000_iterations_without_memory_growth() -> None:
    for rank, out in enumerate(
        run_distributed(_soak, gpu_world_size(), 2000, backend="ep", timeout=600)
    ):
        assert out["failures"] == [], (rank, out["failures"][:5])
        assert out["growth"] <= 8 << 20, (rank, out["growth"])


def _many_rebuilds(rank: int, world: int, rebuilds: int) -> dict:
    """Every step needs a wider row than the transport holds, so each one rebuilds it (drain,
    meet, free, allocate, exchange IPC handles) while outputs of earlier steps still view the old
    receive slabs. Rebuilds once met in Gloo's barrier, where both ranks sometimes waited for the
    whole group timeout (about 1 rebuild in 10 on one H100 with 2 ranks)."""
    import ep_backend as ep
    from ep_backend import reference as ref

    failures: list[str] = []
    held_row_bytes: list[int] = []
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (an output, a copy of it)
    for step in range(rebuilds):
        hidden = 256 + 64 * step
        x, idx, w = _inputs(rank, 96 + 17 * rank, seed=step, hidden=hidden)
        out = ep.dispatch(x, idx, w, E)
        comb = ep.combine(out.recv_x, out.handle, out.recv_topk_weights)
        held = ep.reserve(1, 8, K, E)  # grows nothing: reports what the transport holds
        held_row_bytes.append(held["row_bytes"] if held else -1)
        expected = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
        if not torch.equal(out.recv_x.cpu(), expected.recv_x):
            failures.append(f"step {step}: recv_x")
        want = ref.combine(expected.recv_x, expected.handle, expected.recv_topk_weights)
        if not torch.equal(comb.combined_x.cpu(), want.combined_x):
            failures.append(f"step {step}: combine")
        kept.append((out.recv_x, out.recv_x.clone()))
    for step, (view, copy) in enumerate(kept):  # outputs outlive the transports they came from
        if not torch.equal(view, copy):
            failures.append(f"step {step}: output changed after later rebuilds")
    return {"failures": failures, "held_row_bytes": held_row_bytes}


@pytest.mark.parametrize("one_rank", WORLDS)
def test_many_transport_rebuilds_neither_hang_nor_corrupt(one_rank: bool) -> None:
    rebuilds = 24
    res = run_distributed(_many_rebuilds, _world(one_rank), rebuilds, backend="ep", timeout=300)
    for rank, out in enumerate(res):
        assert out["failures"] == [], (rank, out["failures"][:5])
        held = out["held_row_bytes"]
        # Each step held a wider row than the one before: every step rebuilt the transport.
        assert held == sorted(set(held)), (rank, held)
        assert held[-1] >= (256 + 64 * (rebuilds - 1)) * 2, (rank, held)


def _bad_input_then_valid(rank: int, world: int, overlap: bool, given_layout: bool) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    ep.get_backend().options.overlap_dispatch_host_wait = overlap
    x, idx, w = _inputs(rank, 256, seed=3)
    bad = idx.clone()
    if rank == 1:
        bad[0, 0] = E + 5  # out of range on one rank only
    try:
        # With a layout passed in, get_dispatch_layout's kernel finds the id (it does not raise:
        # that would need a stream sync) and the dispatch raises it on every rank.
        layout = {"layout": ep.get_dispatch_layout(bad, E)} if given_layout else {}
        ep.dispatch(x, bad, w, E, **layout)
        raised = ""
    except RuntimeError as exc:
        raised = str(exc)
    torch.cuda.synchronize()
    # The error was reported once: the next layout and dispatch are fine.
    layout = {"layout": ep.get_dispatch_layout(idx, E)} if given_layout else {}
    out = ep.dispatch(x, idx, w, E, **layout)
    expected = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    return {"raised": raised, "next_ok": torch.equal(out.recv_x.cpu(), expected.recv_x)}


@pytest.mark.parametrize("given_layout", [False, True], ids=["own-layout", "given-layout"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "host-first"])
def test_bad_input_rejected_on_every_rank_before_any_data_moves(
    overlap: bool, given_layout: bool
) -> None:
    """An out-of-range expert id on one rank: the layout kernel finds it, notify tells every rank,
    and all raise; no host read of topk_idx, no extra stream sync. Host-first, no dispatch kernel
    runs; overlapped, the dispatch kernel already launched reads notify's verdict and moves
    nothing (the next dispatch is still right). The same when the layout came from
    get_dispatch_layout and was passed in."""
    res = run_distributed(
        _bad_input_then_valid, gpu_world_size(), overlap, given_layout, backend="ep", timeout=120
    )
    assert "topk_idx values must be in [-1" in res[1]["raised"], res[1]
    assert f"got {E + 5} at token 0, slot 0" in res[1]["raised"], res[1]
    for rank, r in enumerate(res):
        if rank != 1:
            assert "rank(s) 1 rejected their inputs" in r["raised"], (rank, r)
    assert all(r["next_ok"] for r in res)


def _worst_case_overflow_then_next_calls(rank: int, world: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank, 6, seed=21)
    idx.fill_(-1)
    idx[:, 0] = 0  # every token of every rank goes to expert 0 only: 6 * world rows on rank 0
    res: dict = {}
    # No host step in worst-case mode: rank 0's notify records the overflow, the call returns.
    ep.dispatch(x, idx, w, E, num_worst_tokens=6 * world - 1)
    torch.cuda.synchronize()
    try:  # the next call reports it, on every rank (rank 0's peers must not wait or pair)
        ep.dispatch(x, idx, w, E, num_worst_tokens=6 * world)
        res["raised"] = ""
    except ep.MoEInputError as exc:
        res["raised"] = str(exc)
    got = ep.dispatch(x, idx, w, E, num_worst_tokens=6 * world)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, num_worst_tokens=6 * world)
    n = int(want.handle.recv_src_idx.ge(0).sum())  # rows past the received ones: unspecified
    res["next_ok"] = torch.equal(got.recv_x[:n].cpu(), want.recv_x[:n]) and torch.equal(
        got.recv_topk_idx.cpu(), want.recv_topk_idx
    )
    return res


def test_a_worst_case_overflow_is_raised_by_every_rank_at_the_next_call() -> None:
    """A num_worst_tokens dispatch that overflows rank 0: its kernels record it there, and the
    group's next call raises on every rank (rank 0 with the counts, its peers naming it), before
    any data moves; the call after that is exact."""
    world = gpu_world_size()
    res = run_distributed(_worst_case_overflow_then_next_calls, world, backend="ep", timeout=120)
    assert (
        f"would receive {6 * world} rows, more than num_worst_tokens={6 * world - 1}"
        in (res[0]["raised"])
    ), res[0]
    for rank, r in enumerate(res):
        if rank != 0:
            assert "rank(s) 0 rejected their inputs" in r["raised"], (rank, r)
        assert r["next_ok"], (rank, r)


def _nothing_received_by_rank_0(rank: int, world: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank, 40 + rank, seed=33)
    idx[idx.lt(E // world) & idx.ge(0)] = -1  # no row for rank 0's experts: it receives none
    a = ep.dispatch(x, idx, w, E)
    b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    y = scale_rows(a.recv_x, 3.0)
    got = ep.combine(y, a.handle, a.recv_topk_weights, bias=x)
    want = ref.combine(y.cpu(), b.handle, b.recv_topk_weights, bias=x.cpu())
    return {
        "received": a.recv_x.size(0),
        "dispatch_ok": torch.equal(a.recv_x.cpu(), b.recv_x),
        "x_ok": torch.equal(got.combined_x.cpu(), want.combined_x),
        "weights_ok": torch.equal(got.combined_topk_weights.cpu(), want.combined_topk_weights),
    }


def test_combine_with_weights_on_a_rank_that_received_no_rows() -> None:
    """Rank 0 sends tokens but receives no rows: its received weights are an empty tensor (a
    null data pointer). The row layout follows the agreed K, not that pointer, so every rank's
    combined rows and weights match the reference bitwise."""
    world = gpu_world_size()
    res = run_distributed(_nothing_received_by_rank_0, world, backend="ep", timeout=120)
    assert res[0]["received"] == 0, res[0]
    for rank, r in enumerate(res):
        assert r["dispatch_ok"] and r["x_ok"] and r["weights_ok"], (rank, r)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    start = (16 - flat.data_ptr() % 16) % 16 // t.element_size() + 1
    out = flat[start : start + t.numel()].view(t.shape)
    assert out.data_ptr() % 16 != 0
    return out.copy_(t)


def _biases_and_layouts(rank: int, world: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank, 48 + rank, seed=35)
    g = torch.Generator(device="cuda").manual_seed(rank)
    failures: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want):
            failures.append(name)

    a = ep.dispatch(_misaligned(x), idx, w, E)  # the kernel reads an aligned copy
    b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    check("dispatch of a misaligned x", a.recv_x, b.recv_x)
    check("cached dispatch of a misaligned x", ep.dispatch(_misaligned(x), handle=a.handle).recv_x,
          b.recv_x)  # fmt: skip
    T = x.size(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        y = (a.recv_x.float() * 1.5).to(dtype)
        f32 = torch.randn(T, H, device="cuda", generator=g)
        same = torch.randn(T, H, device="cuda", generator=g).to(dtype)
        strided = torch.randn(H, T, device="cuda", generator=g).to(dtype).t()  # not contiguous
        cases = {
            "float32 bias": (f32,),
            "bfloat16 bias": (f32.bfloat16(),),
            "float32 and x-dtype biases": (f32, same),
            "x-dtype and float32 biases": (same, f32),
            "non-contiguous bias": (strided,),
            "misaligned bias": (_misaligned(same),),
        }
        for name, bias in cases.items():
            got = ep.combine(y, a.handle, a.recv_topk_weights, bias=bias)
            want = ref.combine(y.cpu(), b.handle, b.recv_topk_weights,
                               bias=tuple(t.cpu() for t in bias))  # fmt: skip
            check(f"{dtype} x, {name}", got.combined_x, want.combined_x)
        got = ep.combine(_misaligned(y), a.handle, bias=f32)
        check(f"{dtype} misaligned x", got.combined_x,
              ref.combine(y.cpu(), b.handle, bias=f32.cpu()).combined_x)  # fmt: skip
    return {"failures": failures}


def test_combine_biases_of_any_float_dtype_layout_and_misaligned_rows_match_the_spec() -> None:
    """The spec adds each bias in the accumulation type, whatever its float dtype: the kernels
    read biases of x's dtype as they are, float32 ones of 16-bit rows in their own kernels, and
    others widened first; non-contiguous or misaligned biases and misaligned x (a contiguous
    view one element past a 16-byte boundary) are copied. Bitwise against the reference."""
    res = run_distributed(_biases_and_layouts, gpu_world_size(), backend="ep", timeout=120)
    for rank, r in enumerate(res):
        assert r["failures"] == [], (rank, r["failures"])


def _handle_on_the_host(rank: int, world: int) -> dict:
    import dataclasses

    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank, 40, seed=37)
    a = ep.dispatch(x, idx, w, E)
    handle = a.handle
    if rank == 1:  # the kernels would read host pointers
        handle = dataclasses.replace(handle, recv_src_idx=handle.recv_src_idx.cpu())
    raised = {}
    for name, call in (("combine", lambda: ep.combine(a.recv_x, handle)),
                       ("cached dispatch", lambda: ep.dispatch(x, handle=handle))):  # fmt: skip
        try:
            call()
            raised[name] = ""
        except ep.MoEInputError as exc:
            raised[name] = str(exc)
    b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    exact = torch.equal(ep.combine(a.recv_x, a.handle).combined_x.cpu(),
                        ref.combine(b.recv_x, b.handle).combined_x)  # fmt: skip
    return {"raised": raised, "next_ok": exact}


def test_a_handle_on_another_device_than_x_is_refused_on_every_rank() -> None:
    """A handle whose tensors were moved to the host on one rank: that rank names the devices,
    its peers say it rejected its inputs, nothing moves, and the next combine is exact."""
    res = run_distributed(_handle_on_the_host, gpu_world_size(), backend="ep", timeout=120)
    for rank, r in enumerate(res):
        for op, message in r["raised"].items():
            want = (
                "the handle's tensors are on cpu, x on cuda" if rank == 1 else "rank(s) 1 rejected"
            )
            assert want in message, (rank, op, message)
        assert r["next_ok"], rank


def _storage_of_outputs(rank: int, world: int) -> dict:
    """Both dispatch modes against the spec, with the storage each gives its outputs."""
    import ep_backend as ep
    from ep_backend import reference as ref

    options = ep.get_backend().options
    num_tokens = 200 + 37 * rank  # uneven: the worst case is the sum over ranks
    x, idx, w = _inputs(rank, num_tokens, seed=11)
    x8, s8 = ref.quantize_fp8_per128(x)
    expected = ref.dispatch(x8.cpu(), idx.cpu(), w.cpu(), E, x_scales=s8.cpu())
    result: dict = {"worst": sum(200 + 37 * r for r in range(world))}
    for overlap in (True, False):
        options.overlap_dispatch_host_wait = overlap
        out = ep.dispatch(x8, idx, w, E, x_scales=s8)
        combined = ep.combine(out.recv_x.float().bfloat16(), out.handle)
        assert out.recv_x_scales is not None and out.recv_topk_weights is not None
        result[overlap] = {
            "rows": out.recv_x.shape[0],
            "expected_rows": expected.recv_x.shape[0],
            "storage_rows": out.recv_x.untyped_storage().nbytes() // out.recv_x.stride(0),
            "scale_storage_rows": out.recv_x_scales.untyped_storage().nbytes()
            // (4 * out.recv_x_scales.shape[1]),
            "equal": torch.equal(out.recv_x.view(torch.uint8).cpu(),
                                 expected.recv_x.view(torch.uint8))
            and torch.equal(out.recv_x_scales.cpu(), expected.recv_x_scales)
            and torch.equal(out.recv_topk_idx.cpu(), expected.recv_topk_idx)
            and torch.equal(out.recv_topk_weights.cpu(), expected.recv_topk_weights)
            and out.num_recv_tokens_per_expert_list == expected.num_recv_tokens_per_expert_list,
            "combine_shape": tuple(combined.combined_x.shape),
        }  # fmt: skip
    # The option is agreed: ranks that differ get an error, not a hang.
    options.overlap_dispatch_host_wait = rank == 0
    try:
        ep.dispatch(x8, idx, w, E, x_scales=s8)
        result["mismatch"] = ""
    except RuntimeError as exc:
        result["mismatch"] = str(exc)
    return result


@pytest.mark.parametrize("one_rank", WORLDS)
def test_overlapped_dispatch_outputs_are_exact_views_of_worst_case_storage(one_rank: bool) -> None:
    res = run_distributed(_storage_of_outputs, _world(one_rank), backend="ep", timeout=120)
    for rank, r in enumerate(res):
        for overlap in (True, False):
            got = r[overlap]
            assert got["equal"], (rank, overlap)
            assert got["rows"] == got["expected_rows"], (rank, overlap, got)
            assert got["combine_shape"] == (200 + 37 * rank, H), (rank, overlap, got)
        # overlapped: storage for every token of every rank; host-first: the exact rows
        assert r[True]["storage_rows"] == r["worst"] == r[True]["scale_storage_rows"], (rank, r)
        assert r[False]["storage_rows"] == r[False]["rows"], (rank, r)
        if len(res) > 1:  # one rank cannot disagree with itself
            assert "ranks disagree on Options.overlap_dispatch_host_wait" in r["mismatch"], (
                rank,
                r,
            )


def _deferred_count_wait(rank: int, world: int) -> dict:
    """ep.dispatch's eager path defers its count wait (_dispatch_deferred + finish); autograd,
    async_op and the raw op do not. All must give the spec's outputs and a working handle."""
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import moe
    from ep_backend import reference as ref

    counts = [150 + 29 * r for r in range(world)]
    x, idx, w = _inputs(rank, counts[rank], seed=23)
    x8, s8 = ref.quantize_fp8_per128(x)
    want = ref.dispatch(x8.cpu(), idx.cpu(), w.cpu(), E, x_scales=s8.cpu())
    group = dist.group.WORLD.group_name
    native = ep._native()

    def same(out) -> bool:
        return (torch.equal(out.recv_x.view(torch.uint8).cpu(), want.recv_x.view(torch.uint8))
                and torch.equal(out.recv_x_scales.cpu(), want.recv_x_scales)
                and torch.equal(out.recv_topk_idx.cpu(), want.recv_topk_idx)
                and torch.equal(out.recv_topk_weights.cpu(), want.recv_topk_weights)
                and torch.equal(out.handle.recv_src_idx.cpu(), want.handle.recv_src_idx)
                and out.num_recv_tokens_per_expert_list == want.num_recv_tokens_per_expert_list
                and torch.equal(ep.combine(out.recv_x.float().bfloat16(), out.handle)
                                .combined_x.cpu(),
                                ref.combine(want.recv_x.float().bfloat16(), want.handle)
                                .combined_x))  # fmt: skip

    res: dict = {"worst": sum(counts), "rows": want.recv_x.shape[0]}
    # The binding itself: worst-case rows until finish, then the received rows, in place.
    outs, finish = native._dispatch_deferred(x8, s8, idx, w, E, 1, 0, group, [])
    res["before"] = [outs[i].shape[0] for i in (0, 1, 2, 3, 8, 9)]
    res["host_counts_before"] = outs[10].numel()
    res["per_expert"] = finish()
    res["after"] = [outs[i].shape[0] for i in (0, 1, 2, 3, 8, 9)]
    res["want_per_expert"] = want.num_recv_tokens_per_expert_list
    res["exact"] = torch.equal(outs[0].view(torch.uint8).cpu(), want.recv_x.view(torch.uint8))
    # num_worst_tokens: nothing to wait for on the host, so nothing is deferred.
    _, none = native._dispatch_deferred(x8, s8, idx, w, E, 1, sum(counts), group, [])
    res["worst_case_finish"] = none is None
    torch.cuda.synchronize()
    res["eager"] = same(ep.dispatch(x8, idx, w, E, x_scales=s8))
    res["layout"] = same(ep.dispatch(x8, idx, w, E, x_scales=s8,
                                     layout=ep.get_dispatch_layout(idx, E)))  # fmt: skip
    out = ep.dispatch(x8, idx, w, E, x_scales=s8, async_op=True)
    out.work.wait()
    res["async"] = same(out)
    wg = w.clone().requires_grad_()
    res["autograd"] = same(ep.dispatch(x8, idx, wg, E, x_scales=s8))
    raw = moe._dispatch_op(x8, s8, idx, w, E, 1, 0, group, [])
    res["raw"] = torch.equal(raw[0].view(torch.uint8).cpu(), want.recv_x.view(torch.uint8))
    # A rejected topk_idx raises from finish, on every rank, and the next call works.
    bad = idx.clone()
    if rank == world - 1:
        bad[0, 0] = E + 5
    try:
        ep.dispatch(x8, bad, w, E, x_scales=s8)
        res["rejected"] = ""
    except RuntimeError as exc:
        res["rejected"] = str(exc)
    res["after_reject"] = same(ep.dispatch(x8, idx, w, E, x_scales=s8))
    return res


@pytest.mark.parametrize("one_rank", WORLDS)
def test_deferred_count_wait_gives_the_same_outputs_as_every_other_path(one_rank: bool) -> None:
    res = run_distributed(_deferred_count_wait, _world(one_rank), backend="ep", timeout=120)
    for rank, r in enumerate(res):
        assert r["before"] == [r["worst"]] * 6, (rank, r)
        assert r["host_counts_before"] == 0, (rank, r)
        assert r["after"] == [r["rows"]] * 6, (rank, r)
        assert r["per_expert"] == r["want_per_expert"], (rank, r)
        assert r["exact"] and r["worst_case_finish"], (rank, r)
        for path in ("eager", "layout", "async", "autograd", "raw", "after_reject"):
            assert r[path], (rank, path)
        bad_rank = len(res) - 1
        expected = (
            f"got {E + 5} at token 0, slot 0"
            if rank == bad_rank
            else f"rank(s) {bad_rank} rejected their inputs"
        )
        assert expected in r["rejected"], (rank, r["rejected"])


def _shared_memory_near_48_kb(rank: int, world: int) -> dict:
    """Kernels whose dynamic shared memory is just under or at 48 KB: with their static shared
    memory they need the opt-in (a launch without it failed with "invalid argument")."""
    import ep_backend as ep
    from ep_backend import reference as ref

    res: dict = {}
    # Layout: 4 bytes of shared memory per expert.
    for experts in (11_776, 12_288):
        idx = cuda_routing(300, 64, experts, 8, seed=5 + rank)[1]
        got = ep.get_dispatch_layout(idx, experts)
        want = ref.get_dispatch_layout(idx.cpu(), experts, world)
        res[f"layout {experts}"] = torch.equal(
            got.num_tokens_per_expert.cpu(), want.num_tokens_per_expert
        ) and torch.equal(got.is_token_in_rank.cpu(), want.is_token_in_rank)
    # Dispatch of 4 KB rows (BF16, H=2048) into a slab: 6 staging send warps x 2 x 4 KB = 48 KB.
    x, idx, w = cuda_routing(400 + 13 * rank, 2048, E, K, seed=9 + rank)
    out = ep.dispatch(x, idx, w, E)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    res["dispatch 4 KB rows"] = torch.equal(out.recv_x.cpu(), want.recv_x)
    return res


def test_kernels_with_about_48_kb_of_shared_memory_launch() -> None:
    for rank, r in enumerate(
        run_distributed(_shared_memory_near_48_kb, gpu_world_size(), backend="ep", timeout=120)
    ):
        assert r and all(r.values()), (rank, r)


def _send_warp_knobs(rank: int, world: int) -> dict:
    """Groups built with other send-warp splits (EP_DISPATCH_SEND_WARPS[_SMALL_ROWS|_SLAB], read
    when a group builds its transport) give the spec's bits, into a slab and into the buffer."""
    import os

    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    res: dict = {}
    knobs = ("EP_DISPATCH_SEND_WARPS", "EP_DISPATCH_SEND_WARPS_SMALL_ROWS",
             "EP_DISPATCH_SEND_WARPS_SLAB")  # fmt: skip
    for warps in ("1", "5", "14"):
        for knob in knobs:
            os.environ[knob] = warps
        try:
            group = dist.new_group(list(range(world)), backend="ep")
            for hidden in (H, 7168):  # staged rows (<= 8 KB) and, BF16 at 7168, register-path ones
                x, idx, w = _inputs(rank, 300 + 17 * rank, seed=int(warps) + hidden, hidden=hidden)
                x8, s8 = ep.reference.quantize_fp8_per128(x)
                want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
                want8 = ref.dispatch(x8.cpu(), idx.cpu(), w.cpu(), E, x_scales=s8.cpu())
                held = ep.dispatch(x, idx, w, E, group=group)  # into a slab
                held8 = ep.dispatch(x8, idx, w, E, x_scales=s8, group=group)  # the second slab
                buffer = ep.dispatch(x, idx, w, E, group=group)  # none free: the buffer path
                res[f"{warps} warps, H={hidden}"] = (
                    torch.equal(held.recv_x.cpu(), want.recv_x)
                    and torch.equal(buffer.recv_x.cpu(), want.recv_x)
                    and torch.equal(buffer.recv_topk_idx.cpu(), want.recv_topk_idx)
                    and torch.equal(held8.recv_x.view(torch.uint8).cpu(),
                                    want8.recv_x.view(torch.uint8))
                    and torch.equal(held8.recv_x_scales.cpu(), want8.recv_x_scales)
                )  # fmt: skip
                del held, held8, buffer
            dist.destroy_process_group(group)
        finally:
            for knob in knobs:
                del os.environ[knob]
    return res


def test_send_warp_knobs_give_the_same_bits() -> None:
    for rank, r in enumerate(
        run_distributed(_send_warp_knobs, gpu_world_size(), backend="ep", timeout=180)
    ):
        assert len(r) == 6 and all(r.values()), (rank, r)


def _slab_lifetimes(rank: int, world: int) -> dict:
    """Outputs written straight into receive slabs (Options.recv_slabs, default 2): held past
    the pool's size, reused once freed, kept alive past their group, equal to the spec and to a
    group without slabs."""
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    def call(step: int, group=None):
        x, idx, w = _inputs(rank, 300 + 41 * rank + 7 * step, seed=100 + step)
        x8, s8 = ref.quantize_fp8_per128(x) if step % 2 else (x, None)
        out = ep.dispatch(x8, idx, w, E, x_scales=s8, group=group)
        want = ref.dispatch(x8.cpu(), idx.cpu(), w.cpu(), E,
                            x_scales=None if s8 is None else s8.cpu())  # fmt: skip
        return out, want

    def same(out, want, combine: bool = True, group=None) -> bool:
        ok = (torch.equal(out.recv_x.view(torch.uint8).cpu(), want.recv_x.view(torch.uint8))
              and torch.equal(out.recv_topk_idx.cpu(), want.recv_topk_idx)
              and torch.equal(out.recv_topk_weights.cpu(), want.recv_topk_weights)
              and torch.equal(out.handle.recv_src_idx.cpu(), want.handle.recv_src_idx))  # fmt: skip
        if want.recv_x_scales is not None:
            ok = ok and torch.equal(out.recv_x_scales.cpu(), want.recv_x_scales)
        if not combine:
            return ok
        combined = ep.combine(out.recv_x.float().bfloat16(), out.handle, group=group).combined_x
        expected = ref.combine(want.recv_x.float().bfloat16(), want.handle).combined_x
        return ok and torch.equal(combined.cpu(), expected)

    res: dict = {"default": ep.get_backend().options.recv_slabs}
    held = [call(step) for step in range(3)]  # two slabs lent, the third dispatch gets tensors
    torch.cuda.synchronize()
    res["held"] = [same(o, w) for o, w in held]
    del held[0]  # its slab is lent again to the next dispatch, which must not touch the others
    held.append(call(3))
    torch.cuda.synchronize()
    res["reused"] = [same(o, w) for o, w in held]
    res["loop"] = all(same(*call(4 + step)) for step in range(6))  # lend, free, lend again
    # Outputs outlive their group: the slab memory stays until they are freed.
    sub = dist.new_group(list(range(world)), backend="ep")
    kept = call(11, group=sub)
    torch.cuda.synchronize()
    dist.destroy_process_group(sub)
    res["after_destroy"] = same(*kept, combine=False)
    plain = dist.new_group(list(range(world)), backend="ep",
                           pg_options=ep.Options(recv_slabs=0))  # fmt: skip
    res["no_slabs"] = same(*call(12, group=plain), group=plain)  # its handle belongs to plain
    dist.destroy_process_group(plain)
    options = ep.get_backend().options
    options.recv_slabs = 3 if rank == 0 else 2
    try:
        call(13)
        res["mismatch"] = ""
    except RuntimeError as exc:
        res["mismatch"] = str(exc)
    options.recv_slabs = 2
    return res


@pytest.mark.parametrize("one_rank", WORLDS)
def test_receive_slabs_hold_outputs_until_freed_and_match_the_spec(one_rank: bool) -> None:
    res = run_distributed(_slab_lifetimes, _world(one_rank), backend="ep", timeout=300)
    for rank, r in enumerate(res):
        assert r["default"] == 2, (rank, r)
        assert r["held"] == [True] * 3 and r["reused"] == [True] * 3, (rank, r)
        assert r["loop"] and r["after_destroy"] and r["no_slabs"], (rank, r)
        if len(res) > 1:  # one rank cannot disagree with itself
            assert "Options.recv_slabs" in r["mismatch"], (rank, r)


def _is_slab_view(t: torch.Tensor) -> bool:
    import ep_backend as ep

    s = torch.cuda.current_stream()  # already the op's stream: recording it changes nothing
    return ep._C._record_slab_stream(t, s.stream_id, s.device_index, s.device_type)


def _slab_read_on_another_stream(rank: int, world: int) -> dict:
    """A side stream still reading a dispatch's slab outputs when they are freed: with
    ep_backend.record_stream the next dispatch that gets the slab waits for that stream."""
    import ep_backend as ep
    from ep_backend import reference as ref

    x1, idx1, w1 = _inputs(rank, 400 + 3 * rank, seed=301)
    x2, idx2, w2 = _inputs(rank, 400 + 3 * rank, seed=302)
    want = ref.dispatch(x1.cpu(), idx1.cpu(), w1.cpu(), E)
    side = torch.cuda.Stream()
    ep.dispatch(x1, idx1, w1, E)  # connect; its outputs are freed at once
    torch.cuda.synchronize()
    out1 = ep.dispatch(x1, idx1, w1, E)
    first_ptr = out1.recv_x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the read below starts long after the free
        copy = out1.recv_x.clone()

    # _is_slab_view records the dispatch's own stream, which the slab already waits for: only
    # the public call below names `side`, so the test checks that call.
    recognised = [_is_slab_view(out1.handle.recv_src_idx), _is_slab_view(copy)]
    ep.record_stream(out1.recv_x, side)  # one view names the stream for the whole slab
    del out1  # every view freed: the slab goes back, ordered after `side` too
    out2 = ep.dispatch(x2, idx2, w2, E)
    torch.cuda.synchronize()
    return {
        "same_slab": out2.recv_x.data_ptr() == first_ptr,
        "copy_intact": torch.equal(copy.view(torch.uint8).cpu(), want.recv_x.view(torch.uint8)),
        "recognised": recognised,
    }


def test_record_stream_orders_slab_reuse_after_another_stream() -> None:
    res = run_distributed(_slab_read_on_another_stream, gpu_world_size(), backend="ep", timeout=300)
    for rank, r in enumerate(res):
        assert r["same_slab"], (rank, r)  # the slab was lent again: the test saw a reuse
        assert r["copy_intact"], (rank, r)
        assert r["recognised"] == [True, False], (rank, r)


def _cached_dispatch_slabs(rank: int, world: int) -> dict:
    """Cached dispatch writes into receive slabs as dispatch does (BF16 and FP8 with scales,
    async too), falls back to tensors when every slab is held or the group has none, and keeps
    a num_worst_tokens handle's padding; every output equal to the spec."""
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank, 350 + 29 * rank, seed=401)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    x8, s8 = ref.quantize_fp8_per128(x * 0.5)
    x8c, s8c = x8.cpu(), s8.cpu()

    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return (
            a is not None
            and b is not None
            and torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8))
        )

    res: dict = {}
    # Sizes the transport for both row shapes first (a larger need rebuilds it, with new slabs).
    ep.dispatch(x8, idx, w, E, x_scales=s8)
    out = ep.dispatch(x, idx, w, E)  # holds one slab
    bf = ep.dispatch(x * 3, handle=out.handle)
    bf_want = ref.dispatch(x.cpu() * 3, handle=want.handle)
    torch.cuda.synchronize()
    res["bf16"] = [_is_slab_view(bf.recv_x), same(bf.recv_x, bf_want.recv_x)]
    # Both slabs held (out, bf): the next one gets ordinary tensors, still right.
    f8 = ep.dispatch(x8, handle=out.handle, x_scales=s8)
    f8_want = ref.dispatch(x8c, handle=want.handle, x_scales=s8c)
    torch.cuda.synchronize()
    res["fp8_all_held"] = [
        _is_slab_view(f8.recv_x),
        same(f8.recv_x, f8_want.recv_x),
        same(f8.recv_x_scales, f8_want.recv_x_scales),
    ]
    del bf, f8  # a slab is free again
    f8 = ep.dispatch(x8, handle=out.handle, x_scales=s8, async_op=True)
    f8.work.wait()
    torch.cuda.synchronize()
    res["fp8_async"] = [
        _is_slab_view(f8.recv_x) and _is_slab_view(f8.recv_x_scales),
        same(f8.recv_x, f8_want.recv_x),
        same(f8.recv_x_scales, f8_want.recv_x_scales),
    ]
    del f8
    # Many in a row, each freed before the next (lend, give back, lend again).
    res["loop"] = all(
        same(ep.dispatch(x * k, handle=out.handle).recv_x, ref.dispatch(x.cpu() * k,
             handle=want.handle).recv_x)
        for k in (2.0, -1.5, 0.25, 4.0)
    )  # fmt: skip
    # A num_worst_tokens handle: padding rows, so no slab; equal to the spec row for row.
    cap = 600 * world  # more than any rank receives
    wout = ep.dispatch(x, idx, w, E, num_worst_tokens=cap)
    wwant = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, num_worst_tokens=cap)
    wc = ep.dispatch(x * 5, handle=wout.handle)
    torch.cuda.synchronize()
    res["worst"] = [
        _is_slab_view(wc.recv_x),
        same(wc.recv_x, ref.dispatch(x.cpu() * 5, handle=wwant.handle).recv_x),
    ]
    plain = dist.new_group(list(range(world)), backend="ep",
                           pg_options=ep.Options(recv_slabs=0))  # fmt: skip
    pout = ep.dispatch(x, idx, w, E, group=plain)
    pc = ep.dispatch(x * 3, handle=pout.handle, group=plain)
    torch.cuda.synchronize()
    res["no_slabs"] = [_is_slab_view(pc.recv_x), same(pc.recv_x, bf_want.recv_x)]
    dist.destroy_process_group(plain)
    return res


@pytest.mark.parametrize("one_rank", WORLDS)
def test_cached_dispatch_writes_into_receive_slabs(one_rank: bool) -> None:
    res = run_distributed(_cached_dispatch_slabs, _world(one_rank), backend="ep", timeout=300)
    for rank, r in enumerate(res):
        assert r["bf16"] == [True, True], (rank, r)
        assert r["fp8_all_held"] == [False, True, True], (rank, r)
        assert r["fp8_async"] == [True, True, True], (rank, r)
        assert r["loop"], (rank, r)
        assert r["worst"] == [False, True], (rank, r)
        assert r["no_slabs"] == [False, True], (rank, r)


def _handles_many_dispatches_old(rank: int, world: int) -> dict:
    """A model's backward pass: combine and cached dispatch of every MoE layer's handle, in
    reverse, long after later layers dispatched. None of them may read the handle's counts back
    to the host (a stream sync, caught by CUDA's sync debug mode), in normal and worst-case mode
    and for handles made under inference_mode; all match the spec bitwise. A handle the process's
    dispatch did not make (a copy) is read back: the control that shows the mode catches it."""
    import dataclasses

    import ep_backend as ep
    from ep_backend import reference as ref

    layers = 7
    inputs = [_inputs(rank, 200 + 17 * i + 3 * rank, seed=600 + i) for i in range(layers)]
    ep.dispatch(*inputs[0], E)  # connects the transport (its setup synchronises)
    torch.cuda.synchronize()
    res: dict = {"failures": []}

    def check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want):
            res["failures"].append(label)

    for mode in ("normal", "worst", "inference"):
        kwargs = {"num_worst_tokens": 4096} if mode == "worst" else {}
        with torch.inference_mode(mode == "inference"):
            outs = [ep.dispatch(x, idx, w, E, **kwargs) for x, idx, w in inputs]
            torch.cuda.set_sync_debug_mode("error")
            try:
                combined, cached = [], []
                for out, (x, _, _) in zip(reversed(outs), reversed(inputs), strict=True):
                    combined.append(ep.combine(out.recv_x, out.handle, out.recv_topk_weights))
                    cached.append(ep.dispatch(x, handle=out.handle))
                res[f"{mode}_no_sync"] = True
            except RuntimeError as exc:
                res[f"{mode}_no_sync"] = str(exc)
                continue
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for i, (x, idx, w) in enumerate(reversed(inputs)):
            want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, **kwargs)
            comb = ref.combine(want.recv_x, want.handle, want.recv_topk_weights)
            check(f"{mode} combine {i}", combined[i].combined_x, comb.combined_x)
            check(
                f"{mode} combined weights {i}",
                combined[i].combined_topk_weights,
                comb.combined_topk_weights,
            )
            valid = int(want.handle.recv_src_idx.ge(0).sum())
            again = ref.dispatch(x.cpu(), handle=want.handle).recv_x
            check(f"{mode} cached {i}", cached[i].recv_x[:valid], again[:valid])
        del outs, combined, cached
    # The control: a copy of a live handle is not remembered, so its counts are read back.
    out = ep.dispatch(*inputs[0], E)
    copy = dataclasses.replace(
        out.handle,
        num_tokens_per_rank=out.handle.num_tokens_per_rank.clone(),
        num_recv_tokens_per_rank=out.handle.num_recv_tokens_per_rank.clone(),
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ep.combine(out.recv_x, copy)
        res["copy_synced"] = False
    except RuntimeError as exc:
        res["copy_synced"] = "synchroniz" in str(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = ref.dispatch(*(t.cpu() for t in inputs[0]), E)
    check(
        "copy combine",
        ep.combine(out.recv_x, copy).combined_x,
        ref.combine(want.recv_x, want.handle).combined_x,
    )
    # Its cached dispatch computes its send positions (not its receive prefix: the kernel reads
    # the one of the notify that lends a receive slab, which runs since the counts are known).
    check("copy cached dispatch", ep.dispatch(inputs[0][0], handle=copy).recv_x, want.recv_x)
    return res


@pytest.mark.parametrize("one_rank", WORLDS)
def test_backward_order_handles_need_no_host_sync(one_rank: bool) -> None:
    res = run_distributed(_handles_many_dispatches_old, _world(one_rank), backend="ep", timeout=300)
    for rank, r in enumerate(res):
        assert r["failures"] == [], (rank, r)
        assert r["normal_no_sync"] is True, (rank, r)
        assert r["worst_no_sync"] is True, (rank, r)
        assert r["inference_no_sync"] is True, (rank, r)
        assert r["copy_synced"] is True, (rank, r)


def _reserve_then_graphs(rank: int, world: int) -> dict:
    """ep.reserve sizes the transport before capture; once a graph is captured the transport
    never grows: a larger call raises on every rank and the graph still replays correctly."""
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    res: dict = {}
    held = ep.reserve(2000, H, K, E)
    res["held"] = held
    res["held_ok"] = (
        held is not None
        and held["num_tokens"] >= 2000
        and held["row_bytes"] >= 2 * H
        and held["num_topk"] >= K
        and held["num_scales"] >= H // 128
        and held["num_local_experts"] == E // world
    )
    res["smaller_changes_nothing"] = ep.reserve(10, 128, 1, E) == held
    cap = 4096
    x, idx, w = _inputs(rank, 512, seed=700)
    static_x, static_idx, static_w = x.clone(), idx.clone(), w.clone()
    out = ep.dispatch(static_x, static_idx, static_w, E, num_worst_tokens=cap)  # warm-up
    ep.combine(out.recv_x, out.handle, out.recv_topk_weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ep.dispatch(static_x, static_idx, static_w, E, num_worst_tokens=cap)
        comb = ep.combine(out.recv_x * 2, out.handle, out.recv_topk_weights)

    def replay_matches(seed: int) -> bool:
        x, idx, w = _inputs(rank, 512, seed=seed)
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, num_worst_tokens=cap)
        want_c = ref.combine(want.recv_x * 2, want.handle, want.recv_topk_weights)
        return torch.equal(comb.combined_x.cpu(), want_c.combined_x)

    res["replay_before"] = replay_matches(701)
    # Larger than the reservation: refused on every rank, nothing freed.
    big = _inputs(rank, 2500, seed=702)
    try:
        ep.dispatch(*big, E)
        res["big_call"] = "no error"
    except RuntimeError as exc:
        res["big_call"] = str(exc)
    try:
        ep.reserve(8192, H, K, E)
        res["big_reserve"] = "no error"
    except RuntimeError as exc:
        res["big_reserve"] = str(exc)
    res["replay_after"] = replay_matches(703)
    x, idx, w = _inputs(rank, 1999, seed=704)
    got = ep.dispatch(x, idx, w, E)
    res["fitting_call"] = torch.equal(
        got.recv_x.cpu(), ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E).recv_x
    )
    # A fresh group's transport cannot be set up inside a capture.
    fresh = dist.new_group(list(range(world)), backend="ep")
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ep.dispatch(static_x, static_idx, static_w, E, num_worst_tokens=cap, group=fresh)
        res["fresh_capture"] = "no error"
    except RuntimeError as exc:  # ours, or the capture's end raising with ours as context
        res["fresh_capture"] = f"{exc} | {exc.__context__}"
    return res


@pytest.mark.parametrize("one_rank", WORLDS)
def test_reserve_sizes_the_transport_and_captured_graphs_keep_it(one_rank: bool) -> None:
    res = run_distributed(_reserve_then_graphs, _world(one_rank), backend="ep", timeout=300)
    for rank, r in enumerate(res):
        assert r["held_ok"] and r["smaller_changes_nothing"], (rank, r)
        assert r["replay_before"] and r["replay_after"] and r["fitting_call"], (rank, r)
        assert "a CUDA graph captured earlier" in r["big_call"], (rank, r["big_call"])
        assert "Nothing was exchanged" in r["big_call"], (rank, r["big_call"])
        assert "a CUDA graph captured earlier" in r["big_reserve"], (rank, r["big_reserve"])
        assert "cannot be set up while a CUDA graph is captured" in r["fresh_capture"], (
            rank,
            r["fresh_capture"],
        )


def _singleton_groups(rank: int, world: int) -> dict:
    """Expert parallelism of 1 inside a larger job: each rank's MoE group holds only itself
    (every rank creates every singleton group, as new_group requires). Each group runs the
    kernels (reserve sizes them; outputs are receive-slab views) and the low-latency ops, equal to
    the spec, and the world group still works beside them."""
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    groups = [dist.new_group([r], backend="ep") for r in range(world)]
    mine = groups[rank]
    res: dict = {"held": ep.reserve(1024, H, K, E, group=mine) is not None}
    x, idx, w = _inputs(rank, 300 + 50 * rank, seed=900)
    out = ep.dispatch(x, idx, w, E, group=mine)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, group=mine)
    comb = ep.combine(out.recv_x * 2, out.handle, out.recv_topk_weights, group=mine)
    want_c = ref.combine(want.recv_x * 2, want.handle, want.recv_topk_weights, group=mine)
    res["slab"] = _is_slab_view(out.recv_x)
    res["equal"] = (
        torch.equal(out.recv_x.cpu(), want.recv_x)
        and torch.equal(out.recv_topk_idx.cpu(), want.recv_topk_idx)
        and torch.equal(out.recv_topk_weights.cpu(), want.recv_topk_weights)
        and torch.equal(comb.combined_x.cpu(), want_c.combined_x)
        and torch.equal(comb.combined_topk_weights.cpu(), want_c.combined_topk_weights)
    )
    m = 128
    xl, il = x[:m], idx[:m]
    ll = ep.low_latency_dispatch(xl, il, m, E, use_fp8=False, group=mine)
    ll_want = ref.low_latency_dispatch(xl.cpu(), il.cpu(), m, E, use_fp8=False, group=mine)
    res["ll_equal"] = torch.equal(ll.recv_count.cpu(), ll_want.recv_count) and all(
        torch.equal(ll.recv_x[e, :n].cpu(), ll_want.recv_x[e, :n])
        for e, n in enumerate(ll_want.recv_count.tolist())
    )
    res["ll_transport"] = ep.get_backend(mine).low_latency_transport
    total = torch.tensor([rank + 1.0])  # CPU: ranks sharing a GPU cannot use NCCL
    dist.all_reduce(total)
    res["world_sum"] = total.item()
    torch.cuda.synchronize()
    for g in groups:
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return res


def test_singleton_expert_groups_in_a_larger_job() -> None:
    world = gpu_world_size()
    for rank, r in enumerate(run_distributed(_singleton_groups, world, backend="ep", timeout=300)):
        assert r["held"] and r["slab"] and r["equal"] and r["ll_equal"], (rank, r)
        assert r["world_sum"] == world * (world + 1) / 2, (rank, r)
        if nvshmem_built():
            assert r["ll_transport"] == "nvshmem", (rank, r)


def _previous_event(rank: int, world: int) -> dict:
    """previous_event: with async_op the communication stream waits for that event instead of
    the current stream (busy here for ~1 s), for the layout and the dispatch given it; without
    async_op the current stream waits for it."""
    import time

    import ep_backend as ep
    from ep_backend import reference as ref
    from ep_backend._streams import _comm_stream

    x, idx, w = _inputs(rank, 300 + 5 * rank, seed=401)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    # Connect, and make the communication stream: creating a process's first pool stream waits
    # for the work queued on the default stream (~1 s below, measured on H100).
    ep.dispatch(x, idx, w, E, async_op=True).work.wait()
    torch.cuda.synchronize()
    res: dict = {}
    ready = torch.cuda.Event()
    ready.record()
    torch.cuda._sleep(2_000_000_000)  # the current stream stays busy for about a second
    start = time.monotonic()
    # The layout too (DeepEP's get_dispatch_layout flags), on the communication stream, where
    # the dispatch given it runs after it.
    layout = ep.get_dispatch_layout(idx, E, async_op=True, previous_event=ready)
    out = ep.dispatch(x, idx, w, E, async_op=True, previous_event=ready, layout=layout)
    returned = time.monotonic() - start
    done = torch.cuda.Event()
    done.record(_comm_stream(x.device))
    while not done.query() and time.monotonic() - start < 30:
        time.sleep(0.001)
    res["comm_done_while_current_busy"] = done.query() and not torch.cuda.current_stream().query()
    res["seconds"] = (round(returned, 3), round(time.monotonic() - start, 3))
    out.work.wait()
    torch.cuda.synchronize()
    res["async_equal"] = torch.equal(out.recv_x.cpu(), want.recv_x)
    layout.work.wait()
    res["layout_equal"] = torch.equal(
        layout.send_pos.cpu(), ref.get_dispatch_layout(idx.cpu(), E, world).send_pos
    )
    # Synchronous: the current stream waits for an event of another stream first.
    side = torch.cuda.Stream()
    x_late = torch.empty_like(x)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x_late.copy_(x)
        written = torch.cuda.Event()
        written.record()
    out = ep.dispatch(x_late, idx, w, E, previous_event=written)
    torch.cuda.synchronize()
    res["sync_equal"] = torch.equal(out.recv_x.cpu(), want.recv_x)
    combined = ep.combine(out.recv_x, out.handle, async_op=True, previous_event=written)
    combined.work.wait()
    expected = ref.combine(want.recv_x, want.handle).combined_x
    res["combine_equal"] = torch.equal(combined.combined_x.cpu(), expected)
    return res


def test_previous_event_is_what_the_op_waits_for() -> None:
    res = run_distributed(_previous_event, gpu_world_size(), backend="ep", timeout=300)
    for rank, r in enumerate(res):
        assert all(v for k, v in r.items() if k != "seconds"), (rank, r)


def _first_async_call(rank: int, world: int) -> dict:
    import time

    import ep_backend as ep
    from ep_backend import reference as ref

    x, idx, w = _inputs(rank, 200 + 3 * rank, seed=77)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
    out = ep.dispatch(x, idx, w, E)  # synchronous calls only so far
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued work on the current stream
    start = time.monotonic()
    # The group's first async call. A combine (unlike a non-cached dispatch, whose host waits for
    # the receive counts, behind the queued work) has nothing to wait for on the host.
    combined = ep.combine(out.recv_x, out.handle, async_op=True)
    returned = time.monotonic() - start
    combined.work.wait()
    torch.cuda.synchronize()
    expected = ref.combine(want.recv_x, want.handle).combined_x
    return {"returned_s": returned, "equal": torch.equal(combined.combined_x.cpu(), expected)}


def test_the_first_async_call_does_not_wait_for_queued_work() -> None:
    """The communication stream is made at a group's first CUDA call, not at its first async
    one: torch's first stream taken from its pool holds the host until the queued work ends."""
    for rank, r in enumerate(run_distributed(_first_async_call, gpu_world_size(), backend="ep",
                                             timeout=300)):  # fmt: skip
        assert r["equal"], (rank, r)
        assert r["returned_s"] < 0.05, (rank, r)


def _absent_peer(rank: int, world: int) -> str:
    import ep_backend as ep

    x, idx, w = _inputs(rank, 128, seed=5)
    ep.dispatch(x, idx, w, E)  # both ranks connect the transport
    torch.cuda.synchronize()
    ep.get_backend().set_timeout(datetime.timedelta(seconds=5))
    if rank == 1:
        import time

        time.sleep(20)  # alive, but never joins the call
        return "stayed away"
    try:
        ep.dispatch(x, idx, w, E)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_rank_that_never_arrives_gives_an_error_not_a_hang() -> None:
    res = run_distributed(_absent_peer, gpu_world_size(), backend="ep", timeout=120)
    assert res[1] == "stayed away"
    assert res[0] != "no error"
    assert "rank(s) 1 never joined it" in res[0], res[0]


def _transports(rank: int, world: int) -> dict:
    """What each group's CUDA calls run on, and the warning a group that falls back gives once.

    Ranks sharing a GPU cannot run the ATen fallback of a multi-rank group (NCCL needs a GPU per
    rank), so the fallbacks run in groups of one rank: one made while EP_HIGH_THROUGHPUT and
    EP_LOW_LATENCY ask for ATen (no warning), and two plain ones, of which at most one can own
    the process's NVSHMEM (the other falls back, with one warning)."""
    import os
    import warnings

    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    res: dict = {"shared_gpu": world > torch.cuda.device_count()}
    pg = ep.get_backend()
    res["before"] = (pg.high_throughput_transport, pg.low_latency_transport)
    x, idx, w = _inputs(rank, 200 + 17 * rank, seed=70)

    def ht(group=None) -> tuple[bool, list[str]]:
        """A dispatch: (equal to the spec, ep's warnings)."""
        want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E, group=group)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = ep.dispatch(x, idx, w, E, group=group)
            equal = torch.equal(out.recv_x.cpu(), want.recv_x) and torch.equal(
                out.recv_topk_idx.cpu(), want.recv_topk_idx
            )
        return equal, [str(s.message) for s in seen if issubclass(s.category, ep.FallbackWarning)]

    def ll(group=None) -> list[str]:
        """Two low-latency dispatches: ep's warnings."""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                ep.low_latency_dispatch(x[:128], idx[:128], 128, E, use_fp8=False, group=group)
            torch.cuda.synchronize()
        return [str(s.message) for s in seen if issubclass(s.category, ep.FallbackWarning)]

    res["equal"], res["warnings"] = ht()
    if not res["shared_gpu"]:
        res["ll_warnings"] = ll()
    res["after"] = (pg.high_throughput_transport, pg.low_latency_transport)

    def singletons() -> dist.ProcessGroup:
        groups = [dist.new_group([r], backend="ep") for r in range(world)]
        return groups[rank]

    os.environ["EP_HIGH_THROUGHPUT"] = "aten"
    os.environ["EP_LOW_LATENCY"] = "aten"
    try:
        asked = singletons()
        equal, ht_warnings = ht(asked)
        res["asked"] = (equal, ht_warnings + ll(asked))
        asked_pg = ep.get_backend(asked)
        res["asked_transports"] = (
            asked_pg.high_throughput_transport,
            asked_pg.low_latency_transport,
        )
    finally:
        del os.environ["EP_HIGH_THROUGHPUT"], os.environ["EP_LOW_LATENCY"]
    res["plain"] = []
    for _ in range(2):
        g = singletons()
        warned = ll(g)
        res["plain"].append((ep.get_backend(g).low_latency_transport, warned))
    torch.cuda.synchronize()
    return res


def _check_fallback(transport: str, warned: list[str], context) -> None:
    """'nvshmem' and silent, or 'aten: why' with exactly one warning that says why."""
    if transport == "nvshmem":
        assert warned == [], context
    else:
        assert transport.startswith("aten: ") and len(warned) == 1, context
        assert "low-latency MoE ops" in warned[0], context
        assert transport[len("aten: ") :] in warned[0], context


def test_transport_properties_and_fallback_warnings() -> None:
    world = gpu_world_size()
    for rank, r in enumerate(run_distributed(_transports, world, backend="ep", timeout=300)):
        context = (rank, r)
        assert r["before"] == ("undecided", "undecided"), context
        assert r["equal"] and r["warnings"] == [], context
        assert r["after"][0] == "nvlink", context
        if "ll_warnings" in r:
            _check_fallback(r["after"][1], r["ll_warnings"], context)
        # Asked for ATen: ATen, correct, and no warning.
        assert r["asked"] == (True, []), context
        assert r["asked_transports"] == (
            "aten: EP_HIGH_THROUGHPUT=aten",
            "aten: EP_LOW_LATENCY=aten",
        ), context
        # One group per process owns NVSHMEM: at most one of the world group and the two plain
        # one-rank groups runs on it, and every other one warned once.
        transports = [t for t, _ in r["plain"]] + [r["after"][1]]
        assert transports.count("nvshmem") <= 1, context
        for transport, warned in r["plain"]:
            _check_fallback(transport, warned, context)
        if nvshmem_built():
            assert "nvshmem" in transports, context
            assert any("owns NVSHMEM" in t for t, _ in r["plain"]), context
