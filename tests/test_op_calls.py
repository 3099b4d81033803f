"""How the Python layer calls the ``ep`` ops: the typed-dispatcher entries, or ``torch.ops``.

A plain eager call hands its arguments to ``_C._call_<op>`` (``native/backend/moe_op_calls.hpp``),
which runs the op through the dispatcher without Python's argument boxing. These tests pin what
that entry must keep of ``torch.ops.ep.<op>.default`` (2 CPU ranks, the Gloo-backed path):

* the same results, bit for bit, for every op (each call also compared with the reference);
* a ``TorchDispatchMode`` still sees every op under its ``torch.ops`` name (the dispatcher's
  Python key runs for the typed call as for a boxed one), and the profiler names it ``ep::<op>``;
* a ``TorchFunctionMode``, which only Python can honour, takes ``torch.ops`` (it sees the op, and
  the entry is not called).

That the entries release the GIL while the op waits for a late peer: ``tests/test_gil_release.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from _dist_utils import run_distributed
from moe_helpers import (
    Mismatches,
    compare_combine,
    compare_dispatch,
    format_failures,
    make_generator,
    random_topk,
    single_thread,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

E_PER_RANK, K, H, T, M = 3, 2, 128, 9, 16
OPS = ("dispatch_layout", "dispatch", "cached_dispatch", "combine", "low_latency_dispatch",
       "low_latency_combine")  # fmt: skip
ENTRIES = (
    "_call_dispatch_layout",
    "_call_dispatch",
    "_call_cached_dispatch",
    "_call_combine",
    "_call_low_latency_dispatch",
    "_call_low_latency_combine",
)


class _CountingNative:
    """The native module with its ``_call_*`` entries counted."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.calls: dict[str, int] = dict.fromkeys(ENTRIES, 0)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._native, name)
        if name not in self.calls:
            return attr

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            return attr(*args)

        return counted


class _RecordsOps:
    """A mode that records the name of every op it sees, then runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def _record(self, func, args, kwargs):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class _OpNames(_RecordsOps, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs)


class _FunctionNames(_RecordsOps, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs)


def _all_ops(x, idx, w, num_experts):
    """Every op once, in one order on every rank: (layout, dispatch, cached, combine, ll, ll combine)."""
    import ep_backend as ep

    layout = ep.get_dispatch_layout(idx, num_experts)
    out = ep.dispatch(x, idx, w, num_experts)
    cached = ep.dispatch(x, handle=out.handle)
    combined = ep.combine(out.recv_x, out.handle, out.recv_topk_weights)
    ll = ep.low_latency_dispatch(x, idx, M, num_experts, use_fp8=False)
    ll_combined = ep.low_latency_combine(ll.recv_x, idx, w, ll.handle)
    return layout, out, cached, combined, ll, ll_combined


def _op_calls_worker(rank: int, world: int) -> dict[str, Any]:
    from ep_backend import _custom_ops
    from ep_backend import reference as ref

    single_thread()
    num_experts = E_PER_RANK * world
    gen = make_generator(rank, 11)
    x = torch.randn(T, H, generator=gen).bfloat16()
    idx = random_topk(gen, T, K, num_experts)
    w = torch.rand(T, K, generator=gen)
    m = Mismatches(f"rank {rank}")

    counting = _CountingNative(_custom_ops._C)
    _custom_ops._C = counting
    try:
        direct = _all_ops(x, idx, w, num_experts)
        direct_calls = dict(counting.calls)

        saved = _custom_ops._through_torch_ops
        _custom_ops._through_torch_ops = lambda args: True
        try:
            boxed = _all_ops(x, idx, w, num_experts)
        finally:
            _custom_ops._through_torch_ops = saved

        with _OpNames() as dispatch_mode:
            _all_ops(x, idx, w, num_experts)
        with torch.profiler.profile() as profile:
            _all_ops(x, idx, w, num_experts)
        profiled = sorted({e.name for e in profile.events() if e.name.startswith("ep::")})
        counting.calls = dict.fromkeys(ENTRIES, 0)
        with _FunctionNames() as function_mode:
            under_function_mode = _all_ops(x, idx, w, num_experts)
        function_mode_calls = dict(counting.calls)
    finally:
        _custom_ops._C = counting._native

    expected = ref.dispatch(x, idx, w, num_experts)
    for name, result in (
        ("direct", direct),
        ("torch.ops", boxed),
        ("function mode", under_function_mode),
    ):
        layout, out, cached, combined, ll, ll_combined = result
        m.context = f"rank {rank}, {name}"
        m.bitwise(layout.num_tokens_per_rank, boxed[0].num_tokens_per_rank, "per rank")
        m.bitwise(layout.num_tokens_per_expert, boxed[0].num_tokens_per_expert, "per expert")
        m.bitwise(layout.is_token_in_rank, boxed[0].is_token_in_rank, "is_token_in_rank")
        m.bitwise(layout.send_pos, boxed[0].send_pos, "send_pos")
        compare_dispatch(m, out, expected)
        m.bitwise(cached.recv_x, expected.recv_x, "cached recv_x")
        compare_combine(m, combined, ref.combine(expected.recv_x, expected.handle,
                                                 expected.recv_topk_weights))  # fmt: skip
        m.bitwise(ll.recv_x, boxed[4].recv_x, "ll recv_x")
        m.bitwise(ll.recv_count, boxed[4].recv_count, "ll recv_count")
        m.bitwise(ll_combined, boxed[5], "ll combined")
    return {
        "failures": m.items,
        "direct_calls": direct_calls,
        "dispatch_mode": dispatch_mode.names,
        "function_mode": function_mode.names,
        "function_mode_calls": function_mode_calls,
        "profiled": profiled,
    }


def test_entries_equal_torch_ops_and_keep_modes() -> None:
    results = run_distributed(_op_calls_worker, 2, backend="ep", timeout=180)
    assert not any(r["failures"] for r in results), format_failures(
        [r["failures"] for r in results]
    )
    for r in results:
        # A CPU dispatch has no deferred count wait: it takes the op like the others.
        assert r["direct_calls"] == dict.fromkeys(ENTRIES, 1), r["direct_calls"]
        for op in OPS:
            assert f"ep.{op}.default" in r["dispatch_mode"], (op, r["dispatch_mode"])
            assert f"ep.{op}.default" in r["function_mode"], (op, r["function_mode"])
        assert r["function_mode_calls"] == dict.fromkeys(ENTRIES, 0), r["function_mode_calls"]
        # The profiler names the ops as it does through torch.ops.
        assert r["profiled"] == sorted(f"ep::{op}" for op in OPS), r["profiled"]
