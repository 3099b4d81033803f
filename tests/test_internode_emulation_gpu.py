"""Emulated nodes on one host (``EP_RANKS_PER_NODE``): 2 GPUs as 2 nodes x 1, 4 GPUs as 2 x 2 and
4 x 1. Checks the topology each rank sees, that the internode transport serves the group (the
NVLink transport declines it: legs between nodes must not take NVLink), that the per-call
agreement goes through the GPU row exchange, and that dispatch (BF16, FP8), cached dispatch,
combine and the layout's per-node counts equal the reference: bitwise for the copies; combine
bitwise against ``reference.combine_by_node`` (the hierarchical summation order), and against
``reference.combine`` too where a node holds one rank. Also: worst-case mode, async_op, empty
ranks (rank 0, then rank 1, then every rank with T = 0: the sequence the spec test once hung in),
a bad input on one rank, a rank that never joins a call, worst-case dispatch + combine + cached
dispatch captured in a CUDA graph and replayed, four combines in a row captured in a graph with
asymmetric routing, worst-case calls the GPU notify rejects (raised by the next call on every
rank), ``Options.num_sms`` changed on the live group, and a soak (``EP_INTERNODE_SOAK_CALLS``,
default 300).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import warnings
from collections.abc import Callable

import pytest
import torch
from _dist_utils import run_distributed
from moe_helpers import cuda_routing, kernel_grids

pytestmark = pytest.mark.gpu(min_gpus=2)

H, K = 512, 8


# A hang of the internode transport fails these tests in about a minute instead of hanging them:
# its kernels give up after KERNEL_TIMEOUT_S (naming the peer), every host wait of the
# transport is bounded by 1.5 x that + 10 s, and the agreement and store waits by GROUP_TIMEOUT_S,
# all well inside run_distributed's RUN_TIMEOUT_S (which kills the workers and dumps their stacks).
KERNEL_TIMEOUT_S = 15.0
GROUP_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 240.0


def _run_on_internode(fn: Callable[..., dict], world: int, per_node: int, *args: object,
                      timeout: float = RUN_TIMEOUT_S,
                      env: dict[str, str] | None = None) -> list[dict]:  # fmt: skip
    """``fn(rank, world, per_node, *args)`` on ``world`` ranks of nodes of ``per_node`` GPUs, on
    the internode transport; skips where the machine has fewer GPUs."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    return run_distributed(
        fn, world, per_node, *args, backend="ep", timeout=timeout,
        env={"EP_RANKS_PER_NODE": str(per_node), **(env or {})},
    )  # fmt: skip


def _outcome(failures: list[str]) -> dict:
    """What a worker on the internode transport returns: its failures and the transports its
    group took for the ops and for the per-call agreement."""
    import ep_backend as ep

    backend = ep.get_backend()
    return {"failures": failures, "transport": backend.high_throughput_transport,
            "agreement": backend.moe_agreement_transport}  # fmt: skip


def _assert_exact_on_internode(results: list[dict]) -> None:
    """Every rank ran the internode transport, agreed through the GPU exchange, and matched."""
    for rank, r in enumerate(results):
        assert r["transport"] == "internode", (rank, r["transport"])
        assert r["agreement"] == "nvshmem", (rank, r["agreement"])
        assert r["failures"] == [], (rank, r["failures"][:20])


def _fail_fast() -> None:
    """Short timeouts for this worker's group (see KERNEL_TIMEOUT_S)."""
    import ep_backend as ep

    backend = ep.get_backend()
    backend.options.kernel_timeout_s = KERNEL_TIMEOUT_S
    backend.set_timeout(datetime.timedelta(seconds=GROUP_TIMEOUT_S))


class _Progress:
    """Per-step lines on stderr (flushed; pytest shows them when the test fails): where each
    rank was when a run failed or was killed."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.start = time.perf_counter()

    def __call__(self, step: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[internode r{self.rank} {elapsed:7.2f}s] {step}", file=sys.stderr, flush=True)


TOPOLOGIES = [
    pytest.param(2, 1, id="2x1"),
    pytest.param(4, 2, id="2x2", marks=pytest.mark.gpu(min_gpus=4)),
    pytest.param(4, 1, id="4x1", marks=pytest.mark.gpu(min_gpus=4)),
    # Issue 40's 8-GPU topologies: they run wherever 8 GPUs are (skipped with fewer).
    pytest.param(8, 4, id="2x4", marks=pytest.mark.gpu(min_gpus=8)),
    pytest.param(8, 2, id="4x2", marks=pytest.mark.gpu(min_gpus=8)),
]


def _emulated(rank: int, world: int, per_node: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    failures: list[str] = []
    _fail_fast()

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.cpu(), want.cpu()):
            failures.append(name)

    x, idx, w = cuda_routing(300, H, experts, K, seed=rank * 7 + 1)
    xc, idxc, wc = x.cpu(), idx.cpu(), w.cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ep.FallbackWarning)
        layout = ep.get_dispatch_layout(idx, experts)
        nodes = ep.topology().node_of_rank
        check("num_tokens_per_node", layout.num_tokens_per_node,
              ref.get_dispatch_layout(idxc, experts, world, nodes).num_tokens_per_node)  # fmt: skip
        a = ep.dispatch(x, idx, w, experts, layout=layout)
        b = ref.dispatch(xc, idxc, wc, experts)
        check("bf16 recv_x", a.recv_x, b.recv_x)
        check("bf16 recv_topk_idx", a.recv_topk_idx, b.recv_topk_idx)
        check("bf16 recv_topk_weights", a.recv_topk_weights, b.recv_topk_weights)
        if a.num_recv_tokens_per_expert_list != b.num_recv_tokens_per_expert_list:
            failures.append("per-expert counts")
        y = a.recv_x * 3
        check("combine", ep.combine(y, a.handle, a.recv_topk_weights).combined_x,
              ref.combine(y.cpu(), b.handle, b.recv_topk_weights).combined_x)  # fmt: skip
        x2 = x.flip(0).contiguous()
        cached = ep.dispatch(x2, handle=a.handle)
        check("cached recv_x", cached.recv_x, ref.dispatch(x2.cpu(), handle=b.handle).recv_x)
        x8, s8 = ref.quantize_fp8_per128(x.float())
        a8 = ep.dispatch(x8, idx, None, experts, x_scales=s8)
        b8 = ref.dispatch(x8.cpu(), idxc, None, experts, x_scales=s8.cpu())
        check("fp8 recv_x", a8.recv_x.view(torch.uint8), b8.recv_x.view(torch.uint8))
        check("fp8 scales", a8.recv_x_scales, b8.recv_x_scales)
    torch.cuda.synchronize()
    backend = ep.get_backend()
    return {"topology": ep.topology(), "failures": failures,
            "transport": backend.high_throughput_transport,
            "agreement": backend.moe_agreement_transport}  # fmt: skip


@pytest.mark.parametrize("transport", ["aten", "internode"])
@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_emulated_nodes_match_the_reference(world: int, per_node: int, transport: str) -> None:
    import ep_backend as ep

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    # The internode transport serves a group of several nodes by default; EP_HIGH_THROUGHPUT=aten
    # asks for the ATen path.
    env = {
        "EP_RANKS_PER_NODE": str(per_node),
        **({"EP_HIGH_THROUGHPUT": "aten"} if transport == "aten" else {}),
    }
    results = run_distributed(
        _emulated, world, per_node, backend="ep", env=env, timeout=RUN_TIMEOUT_S
    )
    nodes = world // per_node
    for rank, r in enumerate(results):
        t = r["topology"]
        assert t == ep.Topology(
            nodes, per_node, tuple(q // per_node for q in range(world)),
            tuple(q % per_node for q in range(world)), emulated=True,
        ), (rank, t)  # fmt: skip
        assert r["failures"] == [], (rank, r["failures"])
        # Never NVLink across emulated nodes: the internode transport, or ATen where asked for.
        # (the ATen path's name carries its reason: "aten: <why>")
        assert r["transport"].split(":", 1)[0] == transport, r["transport"]
        # Across nodes the ATen path agrees over Gloo (TCP); the internode transport all-gathers
        # the agreement's rows on the GPU once its buffers exist.
        assert r["agreement"] == ("nvshmem" if transport == "internode" else "gloo"), r["agreement"]


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_low_latency_with_emulated_nodes(world: int, per_node: int) -> None:
    """The NVSHMEM low-latency kernels with emulated nodes: peers on other nodes take the put
    path (the runtime leaves them out of its P2P table), peers on the node keep P2P; results
    equal the reference (the checks of test_moe_gpu's low-latency test, which also requires
    the NVSHMEM transport wherever it is built)."""
    from test_moe_gpu import _ll_cuda

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = run_distributed(
        _ll_cuda, world, 1024, 8, 8 * world, backend="ep",
        env={"EP_RANKS_PER_NODE": str(per_node)},
    )  # fmt: skip
    for rank, failures in enumerate(results):
        assert failures == [], (rank, failures)


# ---- the internode transport against the spec ------------------------------------------------


def _compare(
    failures: list[str], name: str, got: torch.Tensor | None, want: torch.Tensor | None
) -> None:
    if got is None or want is None:
        if (got is None) != (want is None):
            failures.append(f"{name}: presence differs")
        return
    got, want = got.cpu(), want.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        failures.append(f"{name}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
        return
    if got.dtype.is_floating_point and got.element_size() == 1:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        bad = (got != want).reshape(got.shape[0], -1).any(1).nonzero().flatten()[:5].tolist()
        failures.append(f"{name}: differs (first rows {bad})")


def _check_dispatch(failures: list[str], tag: str, a, b) -> None:  # noqa: ANN001
    _compare(failures, f"{tag} recv_x", a.recv_x, b.recv_x)
    _compare(failures, f"{tag} recv_x_scales", a.recv_x_scales, b.recv_x_scales)
    _compare(failures, f"{tag} recv_topk_idx", a.recv_topk_idx, b.recv_topk_idx)
    _compare(failures, f"{tag} recv_topk_weights", a.recv_topk_weights, b.recv_topk_weights)
    _compare(failures, f"{tag} per-expert counts", a.num_recv_tokens_per_expert,
             b.num_recv_tokens_per_expert)  # fmt: skip
    if a.num_recv_tokens_per_expert_list != b.num_recv_tokens_per_expert_list:
        failures.append(f"{tag} per-expert list")
    for field in ("recv_src_idx", "recv_src_rank", "num_recv_tokens_per_rank",
                  "num_tokens_per_rank", "is_token_in_rank"):  # fmt: skip
        _compare(failures, f"{tag} handle.{field}", getattr(a.handle, field),
                 getattr(b.handle, field))  # fmt: skip


def _check_combine(
    failures: list[str],
    tag: str,
    y: torch.Tensor,
    a,
    b,
    nodes,
    per_node: int,
    w: torch.Tensor | None = None,
    bias=None,
    progress: _Progress | None = None,
) -> None:  # noqa: ANN001
    import ep_backend as ep
    from ep_backend import reference as ref

    if progress is not None:
        progress(f"{tag}: combine x2")
    got = ep.combine(y, a.handle, w, bias)
    again = ep.combine(y, a.handle, w, bias)
    _compare(failures, f"{tag} combine run to run", got.combined_x, again.combined_x)
    bias_cpu = None
    if bias is not None:
        bias_cpu = tuple(t.cpu() for t in bias) if isinstance(bias, tuple) else bias.cpu()
    wc = w.cpu() if w is not None else None
    want = ref.combine_by_node(y.cpu(), b.handle, nodes, wc, bias_cpu)
    _compare(failures, f"{tag} combine (node order)", got.combined_x, want.combined_x)
    _compare(failures, f"{tag} combine weights (node order)", got.combined_topk_weights,
             want.combined_topk_weights)  # fmt: skip
    flat = ref.combine(y.cpu(), b.handle, wc, bias_cpu)
    if per_node == 1:  # one rank per node: the node order is the rank order
        _compare(failures, f"{tag} combine (rank order)", got.combined_x, flat.combined_x)
    elif not torch.allclose(got.combined_x.cpu().float(), flat.combined_x.float(), rtol=2e-2,
                            atol=2e-2):  # fmt: skip
        failures.append(f"{tag} combine: far from the rank-order sum")


def _spec(rank: int, world: int, per_node: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    failures: list[str] = []
    nodes = ep.topology().node_of_rank
    torch.cuda.set_device(rank % torch.cuda.device_count())
    _fail_fast()
    step = _Progress(rank)
    # Rank 0 sends nothing in the "empty" case.
    for tag, tokens, dtype_idx in (("bf16", 300, torch.int64), ("int32 idx", 77, torch.int32),
                                   ("empty", 0 if rank == 0 else 33, torch.int64)):  # fmt: skip
        x, idx, w = cuda_routing(tokens, H, experts, K, seed=rank * 11 + tokens)
        idx = idx.to(dtype_idx)
        xc, idxc, wc = x.cpu(), idx.cpu(), w.cpu()
        step(f"{tag} ({tokens} tokens): get_dispatch_layout")
        layout = ep.get_dispatch_layout(idx, experts)
        for with_layout in (False, True):
            step(f"{tag}: dispatch layout={with_layout}")
            a = ep.dispatch(x, idx, w, experts, expert_alignment=4,
                            layout=layout if with_layout else None)  # fmt: skip
            step(f"{tag}: reference dispatch")
            b = ref.dispatch(xc, idxc, wc, experts, expert_alignment=4)
            _check_dispatch(failures, f"{tag} layout={with_layout}", a, b)
        y = (a.recv_x.float() * 3 - 1).bfloat16()
        _check_combine(failures, tag, y, a, b, nodes, per_node, a.recv_topk_weights,
                       progress=step)  # fmt: skip
        bias = (torch.randn(tokens, H, device=x.device).bfloat16(),
                torch.randn(tokens, H, device=x.device))  # fmt: skip
        _check_combine(failures, f"{tag} bias", y, a, b, nodes, per_node, None, bias, step)
        _check_combine(failures, f"{tag} float32", y.float(), a, b, nodes, per_node,
                       progress=step)  # fmt: skip
        step(f"{tag}: cached dispatch")
        x2 = torch.randn_like(x.float()).bfloat16()
        _compare(failures, f"{tag} cached recv_x", ep.dispatch(x2, handle=a.handle).recv_x,
                 ref.dispatch(x2.cpu(), handle=b.handle).recv_x)  # fmt: skip
        # FP8 with scales, and its cached dispatch.
        step(f"{tag}: FP8 dispatch and cached dispatch")
        x8, s8 = ref.quantize_fp8_per128(x.float())
        a8 = ep.dispatch(x8, idx, None, experts, x_scales=s8)
        b8 = ref.dispatch(x8.cpu(), idxc, None, experts, x_scales=s8.cpu())
        _check_dispatch(failures, f"{tag} fp8", a8, b8)
        c8 = ep.dispatch(x8, handle=a8.handle, x_scales=s8)
        d8 = ref.dispatch(x8.cpu(), handle=b8.handle, x_scales=s8.cpu())
        _compare(failures, f"{tag} fp8 cached recv_x", c8.recv_x, d8.recv_x)
        _compare(failures, f"{tag} fp8 cached scales", c8.recv_x_scales, d8.recv_x_scales)
        # Worst-case mode: fixed row counts, padding as the reference's.
        worst = 300 * world
        step(f"{tag}: worst-case dispatch")
        aw = ep.dispatch(x, idx, w, experts, num_worst_tokens=worst)
        bw = ref.dispatch(xc, idxc, wc, experts, num_worst_tokens=worst)
        _check_dispatch(failures, f"{tag} worst", aw, bw)
        _check_combine(failures, f"{tag} worst", aw.recv_x, aw, bw, nodes, per_node,
                       progress=step)  # fmt: skip
        # async_op: the outputs once the Work is waited for.
        step(f"{tag}: async dispatch")
        aa = ep.dispatch(x, idx, w, experts, async_op=True)
        if aa.work is not None:
            aa.work.wait()
        _check_dispatch(failures, f"{tag} async", aa, ref.dispatch(xc, idxc, wc, experts))
    torch.cuda.synchronize()
    step("done")
    return _outcome(failures)


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_transport_matches_the_spec(world: int, per_node: int) -> None:
    results = _run_on_internode(_spec, world, per_node)
    summary = {rank: (r["transport"], len(r["failures"])) for rank, r in enumerate(results)}
    print(f"internode spec {world // per_node}x{per_node}: {summary}")
    _assert_exact_on_internode(results)


# Tokens of each rank in the empty-rank sequence: rank 0 empty, then rank 1, then every rank.
# (tag, ranks with no tokens or None for all, whether rank 0 receives no rows)
EMPTY_PHASES = (
    ("rank 0 empty", (0,), False),
    ("rank 1 empty", (1,), False),
    ("all empty", None, False),
    ("nothing received by rank 0", (), True),  # its received weights: a null data pointer
)


def _empty_ranks(rank: int, world: int, per_node: int, grown_first: bool) -> dict:
    """The sequence the spec test once hung in (issue #40, "empty"): in each phase two
    dispatches (without and with a layout) and a combine after each, where some ranks have
    T = 0; every output bitwise against the reference. ``grown_first``: first a full dispatch
    and a float32 combine, which grows the buffers (a collective rebuild that also restarts the
    NVSHMEM session for the larger heap), as the spec test did before its "empty" case."""
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    failures: list[str] = []
    nodes = ep.topology().node_of_rank
    torch.cuda.set_device(rank % torch.cuda.device_count())
    _fail_fast()
    step = _Progress(rank)
    if grown_first:
        x, idx, w = cuda_routing(300, H, experts, K, seed=rank + 77)
        step("full dispatch before the empty phases")
        a = ep.dispatch(x, idx, w, experts)
        b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts)
        _check_dispatch(failures, "full", a, b)
        step("float32 combine (grows the buffers)")
        y = a.recv_x.float()
        got = ep.combine(y, a.handle)
        want = ref.combine_by_node(y.cpu(), b.handle, nodes)
        _compare(failures, "full float32 combine", got.combined_x, want.combined_x)
    for phase, (tag, empty, none_to_rank_0) in enumerate(EMPTY_PHASES):
        tokens = 0 if empty is None or rank in empty else 29 + 5 * rank
        x, idx, w = cuda_routing(tokens, H, experts, K, seed=1000 * phase + rank)
        if none_to_rank_0:
            idx[idx.lt(experts // world) & idx.ge(0)] = -1
        xc, idxc, wc = x.cpu(), idx.cpu(), w.cpu()
        layout = ep.get_dispatch_layout(idx, experts)
        for with_layout in (False, True):
            name = f"{tag} layout={with_layout}"
            step(f"{name} ({tokens} tokens): dispatch")
            a = ep.dispatch(x, idx, w, experts, expert_alignment=4,
                            layout=layout if with_layout else None)  # fmt: skip
            b = ref.dispatch(xc, idxc, wc, experts, expert_alignment=4)
            _check_dispatch(failures, name, a, b)
            step(f"{name}: combine")
            y = (a.recv_x.float() * 3 - 1).bfloat16()
            got = ep.combine(y, a.handle, a.recv_topk_weights)
            want = ref.combine_by_node(y.cpu(), b.handle, nodes, b.recv_topk_weights)
            _compare(failures, f"{name} combine", got.combined_x, want.combined_x)
            _compare(failures, f"{name} combine weights", got.combined_topk_weights,
                     want.combined_topk_weights)  # fmt: skip
            if per_node == 1:
                flat = ref.combine(y.cpu(), b.handle, b.recv_topk_weights)
                _compare(failures, f"{name} combine (rank order)", got.combined_x,
                         flat.combined_x)  # fmt: skip
    torch.cuda.synchronize()
    step("done")
    return _outcome(failures)


@pytest.mark.parametrize("grown_first", [False, True], ids=["fresh", "grown-first"])
@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_empty_ranks_match_the_reference(
    world: int, per_node: int, grown_first: bool
) -> None:
    results = _run_on_internode(_empty_ranks, world, per_node, grown_first,
                                env={"EP_INTERNODE_TRACE": "1"})  # fmt: skip
    _assert_exact_on_internode(results)


def _bad_input_then_exact(rank: int, world: int, per_node: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    _fail_fast()
    x, idx, w = cuda_routing(64, H, experts, K, seed=rank + 5)
    bad = idx.clone()
    if rank == world - 1:
        bad[3, 0] = experts  # out of range on one rank only
    raised = ""
    try:
        ep.dispatch(x, bad, w, experts)
    except Exception as exc:  # noqa: BLE001 - every rank must raise, whatever the type
        raised = f"{type(exc).__name__}: {exc}"[:200]
    failures: list[str] = []
    # The dispatch raised the bad ids itself: no layout error is left behind for the next
    # get_dispatch_layout on this device to raise.
    layout = ep.get_dispatch_layout(idx, experts)
    a = ep.dispatch(x, idx, w, experts, layout=layout)
    b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts)
    _check_dispatch(failures, "after bad input", a, b)
    torch.cuda.synchronize()
    return {"raised": raised, "failures": failures}


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_bad_input_raises_everywhere_then_exact(world: int, per_node: int) -> None:
    results = _run_on_internode(_bad_input_then_exact, world, per_node)
    for rank, r in enumerate(results):
        assert r["raised"], (rank, "did not raise")
        if rank == world - 1:  # the rank with the bad id names it; its peers name that rank
            assert "outside [-1, num_experts" in r["raised"], (rank, r["raised"])
        else:
            assert f"rank(s) {world - 1}" in r["raised"], (rank, r["raised"])
        assert r["failures"] == [], (rank, r["failures"])


def _graph_replays(rank: int, world: int, per_node: int) -> dict:
    """Worst-case dispatch, combine and cached dispatch captured in one CUDA graph (the counts
    are notified on the GPU; nothing is read on the host), replayed with new inputs copied into
    the captured ones, each replay against the reference; then eager calls between replays (the
    kernels take the call number from the device, so replays and eager calls interleave)."""
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    worst = 160 * world
    nodes = ep.topology().node_of_rank
    failures: list[str] = []
    _fail_fast()
    step = _Progress(rank)
    x, idx, w = cuda_routing(160, H, experts, K, seed=rank + 300)
    static_x, static_idx, static_w = x.clone(), idx.clone(), w.clone()
    static_x2 = torch.randn_like(x.float()).bfloat16()
    step("eager warm-up")
    warm = ep.dispatch(static_x, static_idx, static_w, experts, num_worst_tokens=worst)
    ep.combine(warm.recv_x, warm.handle, warm.recv_topk_weights)
    ep.dispatch(static_x2, handle=warm.handle)
    torch.cuda.synchronize()
    step("capture")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ep.dispatch(static_x, static_idx, static_w, experts, num_worst_tokens=worst)
        comb = ep.combine(out.recv_x * 2, out.handle, out.recv_topk_weights)
        cached = ep.dispatch(static_x2, handle=out.handle)

    def replay(seed: int) -> None:
        x, idx, w = cuda_routing(160, H, experts, K, seed=seed)
        x2 = torch.randn_like(x.float()).bfloat16()
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        static_x2.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts, num_worst_tokens=worst)
        _check_dispatch(failures, f"replay {seed}", out, want)
        want_c = ref.combine_by_node(want.recv_x * 2, want.handle, nodes, want.recv_topk_weights)
        _compare(failures, f"replay {seed} combine", comb.combined_x, want_c.combined_x)
        _compare(failures, f"replay {seed} combine weights", comb.combined_topk_weights,
                 want_c.combined_topk_weights)  # fmt: skip
        _compare(failures, f"replay {seed} cached", cached.recv_x,
                 ref.dispatch(x2.cpu(), handle=want.handle).recv_x)  # fmt: skip

    for i in range(3):
        step(f"replay {i}")
        replay(1000 * rank + i)
    step("eager calls between replays")
    x, idx, w = cuda_routing(90, H, experts, K, seed=rank + 400)
    a = ep.dispatch(x, idx, w, experts)
    _check_dispatch(failures, "eager after replays", a,
                    ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts))  # fmt: skip
    replay(1000 * rank + 7)
    torch.cuda.synchronize()
    step("done")
    # The agreement's rows went through the GPU exchange while the graph was captured too.
    return _outcome(failures)


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_worst_case_graph_capture_and_replay(world: int, per_node: int) -> None:
    results = _run_on_internode(_graph_replays, world, per_node)
    _assert_exact_on_internode(results)


def _combines_in_a_graph(rank: int, world: int, per_node: int) -> dict:
    """Four combines in a row over one handle, captured in one CUDA graph and replayed: no
    notify runs between them, so what keeps two RDMA peers within one call of each other (the
    partial buffers have two parities) is the combine's own start signal. The routing is
    asymmetric (rank 0 sends only to its own node, the others everywhere), so a source does not
    wait for every node's partials. Each replay's four outputs against the reference."""
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    nodes = ep.topology().node_of_rank
    failures: list[str] = []
    _fail_fast()
    step = _Progress(rank)
    x, idx, w = cuda_routing(128, H, experts, K, seed=rank + 500)
    if rank == 0:  # only the experts of node 0 (8 per rank): every token stays on its node
        g = torch.Generator().manual_seed(77)
        own = [torch.randperm(8 * per_node, generator=g)[:K] for _ in range(x.size(0))]
        idx = torch.stack(own).to(idx.device, idx.dtype)
    a = ep.dispatch(x, idx, w, experts)
    want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts)
    _check_dispatch(failures, "eager dispatch", a, want)
    ys = [torch.randn_like(a.recv_x.float()).bfloat16() for _ in range(4)]
    for y in ys:  # eager warm-up: the combine's buffers exist before the capture
        ep.combine(y, a.handle, a.recv_topk_weights)
    torch.cuda.synchronize()
    step("capture")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [ep.combine(y, a.handle, a.recv_topk_weights) for y in ys]
    for i in range(5):
        step(f"replay {i}")
        fresh = [torch.randn_like(y.float()).bfloat16() for y in ys]
        for y, f in zip(ys, fresh, strict=True):
            y.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        for k, (out, f) in enumerate(zip(outs, fresh, strict=True)):
            want_c = ref.combine_by_node(f.cpu(), want.handle, nodes, want.recv_topk_weights)
            _compare(failures, f"replay {i} combine {k}", out.combined_x, want_c.combined_x)
    step("done")
    return _outcome(failures)


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_consecutive_combines_in_a_graph(world: int, per_node: int) -> None:
    results = _run_on_internode(_combines_in_a_graph, world, per_node)
    _assert_exact_on_internode(results)


def _live_num_sms(rank: int, world: int, per_node: int) -> dict:
    """``Options.num_sms`` set on the live group between calls: the next calls' kernels take
    that many blocks, and every call is exact."""
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    nodes = ep.topology().node_of_rank
    failures: list[str] = []
    _fail_fast()
    opts = ep.get_backend().options
    for step, num_sms in enumerate([24, 8, 32, 24]):
        opts.num_sms = num_sms
        x, idx, w = cuda_routing(128, H, experts, K, seed=step * 97 + rank)

        def calls(x: torch.Tensor = x, idx: torch.Tensor = idx, w: torch.Tensor = w) -> tuple:
            a = ep.dispatch(x, idx, w, experts)
            return a, ep.combine(a.recv_x, a.handle, a.recv_topk_weights)

        # put_forward: the dispatch's RDMA and NVLink legs; combine_reduce_out: the combine's
        # reduction and sum.
        (a, comb), grids = kernel_grids(calls, ("put_forward", "combine_reduce_out"))
        for key in ("put_forward", "combine_reduce_out"):
            if grids.get(key) != {num_sms}:
                failures.append(f"num_sms={num_sms}: {key} grids {grids.get(key)}")
        want = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts)
        _check_dispatch(failures, f"num_sms={num_sms}", a, want)
        want_c = ref.combine_by_node(want.recv_x, want.handle, nodes, want.recv_topk_weights)
        _compare(failures, f"num_sms={num_sms} combine", comb.combined_x, want_c.combined_x)
    return _outcome(failures)


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_num_sms_set_on_a_live_group_changes_the_next_calls_grid(
    world: int, per_node: int
) -> None:
    results = _run_on_internode(_live_num_sms, world, per_node)
    _assert_exact_on_internode(results)


def _worst_case_rejected_then_exact(rank: int, world: int, per_node: int) -> dict:
    """A worst-case dispatch whose num_worst_tokens is too small, then one with an out-of-range
    id on one rank: no host step sees either, so each moves nothing (padding only) and the next
    call raises on every rank; the call after that is exact."""
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    _fail_fast()
    x, idx, w = cuda_routing(64, H, experts, K, seed=rank + 21)
    raised: list[str] = []
    padding_only: list[bool] = []
    for case in ("too small", "bad id"):
        bad = idx.clone()
        if case == "bad id" and rank == 0:
            bad[5, 1] = -7
        limit = 3 if case == "too small" else 64 * world
        out = ep.dispatch(x, bad, w, experts, num_worst_tokens=limit)
        padding_only.append(bool(out.recv_topk_idx.eq(-1).all()) and
                            bool(out.handle.recv_src_rank.eq(-1).all()))  # fmt: skip
        try:
            ep.dispatch(x, idx, w, experts)
            raised.append("")
        except RuntimeError as exc:
            raised.append(str(exc))
    failures: list[str] = []
    a = ep.dispatch(x, idx, w, experts, num_worst_tokens=64 * world)
    _check_dispatch(failures, "after the rejections", a,
                    ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts,
                                 num_worst_tokens=64 * world))  # fmt: skip
    torch.cuda.synchronize()
    return {"raised": raised, "padding_only": padding_only, "failures": failures}


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_worst_case_rejection_raises_next_call_everywhere(
    world: int, per_node: int
) -> None:
    results = _run_on_internode(_worst_case_rejected_then_exact, world, per_node)
    for rank, r in enumerate(results):
        too_small, bad_id = r["raised"]
        assert "more than num_worst_tokens=3" in too_small, (rank, too_small)
        assert "top-k id(s) outside" in bad_id and "rank 0 " in bad_id, (rank, bad_id)
        assert r["padding_only"] == [True, True], (rank, r["padding_only"])
        assert r["failures"] == [], (rank, r["failures"])


def _absent_rank(rank: int, world: int, per_node: int) -> dict:
    """The last rank stays alive but never joins a dispatch; every other rank must raise naming
    it within the group timeout (plus the stalled-rank probe)."""
    import ep_backend as ep

    experts = 8 * world
    _fail_fast()
    x, idx, w = cuda_routing(64, H, experts, K, seed=rank + 31)
    ep.dispatch(x, idx, w, experts)  # every rank sets the transport up
    torch.cuda.synchronize()
    ep.get_backend().set_timeout(datetime.timedelta(seconds=ABSENT_TIMEOUT_S))
    if rank == world - 1:
        time.sleep(ABSENT_TIMEOUT_S + 10)  # alive, but never joins the call
        return {"raised": "stayed away", "seconds": 0.0}
    start = time.monotonic()
    try:
        ep.dispatch(x, idx, w, experts)
        raised = "no error"
    except RuntimeError as exc:
        raised = str(exc)
    return {"raised": raised, "seconds": time.monotonic() - start}


ABSENT_TIMEOUT_S = 5.0


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_a_rank_that_never_arrives_is_named_on_every_live_rank(
    world: int, per_node: int
) -> None:
    results = _run_on_internode(_absent_rank, world, per_node)
    absent = world - 1
    assert results[absent]["raised"] == "stayed away"
    for rank, r in enumerate(results[:absent]):
        assert f"rank(s) {absent} never joined it" in r["raised"], (rank, r["raised"])
        # The group timeout, then the 2 s stalled-rank probe (and Gloo's own teardown).
        assert r["seconds"] < ABSENT_TIMEOUT_S + 8, (rank, r["seconds"])


def _failed_setup_then_exact(rank: int, world: int, per_node: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    _fail_fast()
    x, idx, w = cuda_routing(64, H, experts, K, seed=rank + 9)
    if rank == world - 1:
        ep._C._fail_next_nvshmem_setup()  # this rank's buffers fail after it made its own
    start = time.monotonic()
    raised = ""
    try:
        ep.dispatch(x, idx, w, experts)
    except RuntimeError as exc:
        raised = str(exc)
    seconds = time.monotonic() - start
    failures: list[str] = []
    a = ep.dispatch(x, idx, w, experts)  # sets the buffers up again
    b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts)
    _check_dispatch(failures, "after the failed setup", a, b)
    torch.cuda.synchronize()
    transport = ep.get_backend().high_throughput_transport
    return {"raised": raised, "seconds": seconds, "failures": failures, "transport": transport}


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_setup_failing_on_one_rank_raises_everywhere_then_exact(
    world: int, per_node: int
) -> None:
    """The last rank's buffer setup fails (test hook) after it made its own buffers: no rank
    enters nvshmem_malloc, every rank raises naming it within the group timeout, and the next
    dispatch sets the buffers up and is exact."""
    results = _run_on_internode(_failed_setup_then_exact, world, per_node)
    for rank, r in enumerate(results):
        assert f"rank(s) {world - 1} failed making the NVSHMEM buffers" in r["raised"], (rank, r)
        assert "injected by a test" in r["raised"], (rank, r["raised"])
        assert r["seconds"] < GROUP_TIMEOUT_S, (rank, r["seconds"])
        assert r["failures"] == [], (rank, r["failures"])
        assert r["transport"] == "internode", (rank, r["transport"])


def _soak(rank: int, world: int, per_node: int, calls: int) -> dict:
    import ep_backend as ep
    from ep_backend import reference as ref

    experts = 8 * world
    nodes = ep.topology().node_of_rank
    failures: list[str] = []
    _fail_fast()
    step = _Progress(rank)
    g = torch.Generator().manual_seed(1234 + rank)
    floor = None
    for i in range(calls):
        tokens = int(torch.randint(0, 257, (1,), generator=g))
        x, idx, w = cuda_routing(tokens, H, experts, K, seed=rank * 100_003 + i)
        a = ep.dispatch(x, idx, w, experts)
        y = a.recv_x
        out = ep.combine(y, a.handle, a.recv_topk_weights)
        if i % 25 == 0:
            step(f"soak call {i}")
            b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), experts)
            _check_dispatch(failures, f"soak {i}", a, b)
            want = ref.combine_by_node(y.cpu(), b.handle, nodes, b.recv_topk_weights)
            _compare(failures, f"soak {i} combine", out.combined_x, want.combined_x)
        del a, y, out
        if i == min(50, calls - 1):
            torch.cuda.synchronize()
            floor = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    end = torch.cuda.memory_allocated()
    return {"failures": failures, "growth": end - (floor or end)}


@pytest.mark.parametrize(("world", "per_node"), TOPOLOGIES)
def test_internode_soak(world: int, per_node: int) -> None:
    calls = int(os.environ.get("EP_INTERNODE_SOAK_CALLS", "300"))
    results = _run_on_internode(_soak, world, per_node, calls, timeout=900.0)
    print(f"internode soak {world // per_node}x{per_node}, {calls} calls: "
          f"{[(len(r['failures']), r['growth']) for r in results]}")  # fmt: skip
    for rank, r in enumerate(results):
        assert r["failures"] == [], (rank, r["failures"][:10])
        assert r["growth"] < 16 << 20, (rank, "device memory grew", r["growth"])
