"""The scenario of a rank killed with SIGKILL in the middle of an MoE call, CPU and CUDA alike.

``killed_mid_call(rank, world, victim, case, timing)`` (a worker for
``_killed_rank_harness.run_with_killed_rank``) runs on every rank:

1. an ``"ep"`` group with a short group timeout (and, on CUDA, a short ``kernel_timeout_s``);
   a few normal calls on it, so that its transports are built: dispatch + combine (NVLink on
   CUDA), and on CUDA low-latency dispatch + combine (NVSHMEM where built);
2. the victim dies, its peers being in the same call:

   * ``"before_call"`` (CPU): the victim SIGKILLs itself just before its dispatch, while its
     peers wait for it in theirs (in the call's agreement);
   * ``"after_agreement"`` (CPU): the victim enters the dispatch, passes the agreement with its
     peers, and dies before its data exchange (a test hook holds it there), its peers waiting
     for its rows in the Gloo exchange;
   * ``"ht_dispatch"`` (CUDA): the victim's stream is held busy (``torch.cuda._sleep``), so its
     kernels never run; it enters the dispatch (the agreement passes: every rank is there), and
     dies 1 s later while its peers' kernels wait for its counts;
   * ``"ll_dispatch"`` (CUDA): as above, with a low-latency dispatch, which returns on the host
     at once: the victim SIGKILLs itself right after it returned, its peers' kernels waiting;

3. each survivor records: the exception its call (or, for the low-latency dispatch, which
   returns before its kernel ends, its next call) raised, its message, ``exc.ranks`` and the
   seconds to raise; on CUDA whether ``torch.cuda.synchronize()`` returned (the kernels that
   waited for the victim ended) and whether a new CUDA op then works; whether
   ``ep_backend.abort(group)`` returned and how long it took; then whether a new ``"ep"`` group
   of the survivors (``use_local_synchronization=True``: the victim cannot take part) runs a
   dispatch + combine equal to ``ep_backend.reference`` bit for bit (the reference runs on a
   Gloo group of the survivors, on CPU copies). The new group is left to the normal teardown
   (``destroy_process_group`` at exit), which the harness times.

Every step runs in a thread under a bound, so a hang is reported as such instead of stalling
the worker (the harness kills what is left).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _killed_rank_harness import sigkill_self_after
from moe_helpers import Mismatches, compare_combine, compare_dispatch, compare_ll_dispatch

CASES = ("before_call", "after_agreement", "ht_dispatch", "ll_dispatch")
CPU_CASES = ("before_call", "after_agreement")


@dataclass(frozen=True)
class Timing:
    """Timeouts of the scenario, in seconds."""

    group_timeout: float  # Options.timeout of the MoE group (host agreement, store waits)
    kernel_timeout: float  # Options.kernel_timeout_s (CUDA kernels' spin-waits)
    step_bound: float  # the most any one step may take before it counts as hung

    def raise_bound(self) -> float:
        """The latest a survivor may raise after entering the call: a kernel timeout, then an
        agreement that waits out the group timeout for the dead rank, plus slack."""
        return self.kernel_timeout + self.group_timeout + 5.0


def _bounded(seconds: float, step: Callable[[], Any]) -> dict[str, Any]:
    """Runs ``step`` in a thread (on this thread's CUDA device); waits at most ``seconds``.

    Returns ``{"returned": bool, "seconds": float, "value": ..., "error": exc or None}``; a step
    still running at the bound has ``returned=False`` (its thread is left behind).
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    out: dict[str, Any] = {"returned": False, "value": None, "error": None}

    def body() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        try:
            out["value"] = step()
        except BaseException as exc:  # recorded for the parent
            out["error"] = exc
        out["returned"] = True

    start = time.monotonic()
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    out["seconds"] = time.monotonic() - start
    return out


def _describe(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    import ep_backend as ep

    return {
        "type": type(exc).__name__,
        "timeout": isinstance(exc, ep.MoETimeoutError),
        "ranks": tuple(getattr(exc, "ranks", ())),
        "message": str(exc)[:2000],
    }


def _store_barrier(name: str, world: int) -> None:
    """Every rank arrives (WORLD's store; no collective of a group the victim will break)."""
    store = dist.distributed_c10d._get_default_store()
    store.add(f"killed_rank/{name}", 1)
    deadline = time.monotonic() + 120
    while store.add(f"killed_rank/{name}", 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"store barrier {name!r}: not every rank arrived in 120 s")
        time.sleep(0.01)


def _inputs(rank: int, step: int, num_experts: int, device: torch.device, tokens: int = 48):
    """BF16 ``x [T, 512]``, int64 ``topk_idx [T, 4]`` in ``[-1, E)``, float32 weights."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn((tokens, 512), generator=gen).to(torch.bfloat16)
    idx = torch.randint(-1, num_experts, (tokens, 4), generator=gen)
    w = torch.rand((tokens, 4), generator=gen)
    return x.to(device), idx.to(device), w.to(device)


def _round_trip(ep: Any, ref: Any, group: Any, ref_group: Any, rank: int, step: int,
                num_experts: int, device: torch.device, low_latency: bool) -> list[str]:  # fmt: skip
    """Dispatch + combine on ``group`` against the reference on ``ref_group`` (CPU copies)."""
    m = Mismatches(context=f"survivors' group, step {step}")
    x, idx, w = _inputs(rank, step, num_experts, device)
    a = ep.dispatch(x, idx, w, num_experts, group=group)
    b = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), num_experts, group=ref_group)
    compare_dispatch(m, a, b)
    y = (b.recv_x.float() * 0.75).to(torch.bfloat16)
    got = ep.combine(y.to(device), a.handle, a.recv_topk_weights, group=group)
    compare_combine(m, got, ref.combine(y, b.handle, b.recv_topk_weights, group=ref_group))
    if low_latency:
        la = ep.low_latency_dispatch(x, idx, x.shape[0], num_experts, use_fp8=False, group=group)
        lb = ref.low_latency_dispatch(x.cpu(), idx.cpu(), x.shape[0], num_experts, use_fp8=False,
                                      group=ref_group)  # fmt: skip
        compare_ll_dispatch(m, la, lb)
    return m.items


def killed_mid_call(rank: int, world: int, victim: int, case: str, timing: Timing) -> Any:
    """The worker (see the module docstring). The victim never returns."""
    import ep_backend as ep
    from ep_backend import reference as ref

    assert case in CASES, case
    on_cuda = case not in CPU_CASES
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    if not on_cuda:
        torch.set_num_threads(1)
    group = dist.new_group(backend="ep", timeout=datetime.timedelta(seconds=timing.group_timeout))
    backend = ep.get_backend(group)
    backend.options.kernel_timeout_s = timing.kernel_timeout
    num_experts = 8 * world
    out: dict[str, Any] = {}
    for step in range(2):  # the transports are built, and work
        x, idx, w = _inputs(rank, step, num_experts, device)
        d = ep.dispatch(x, idx, w, num_experts, group=group)
        ep.combine(d.recv_x, d.handle, d.recv_topk_weights, group=group)
        if on_cuda:
            ld = ep.low_latency_dispatch(x, idx, x.shape[0], num_experts, use_fp8=False,
                                         group=group)  # fmt: skip
            ep.low_latency_combine(ld.recv_x, idx, w, ld.handle, group=group)
    if on_cuda:
        torch.cuda.synchronize()
        out["high_throughput_transport"] = backend.high_throughput_transport
        out["low_latency_transport"] = backend.low_latency_transport
    x, idx, w = _inputs(rank, 9, num_experts, device)
    _store_barrier("before_the_kill", world)

    if rank == victim:
        if case == "before_call":
            time.sleep(0.3)  # the peers are in their dispatch by now
        elif case == "after_agreement":
            ep._C._set_test_exchange_delay(60_000)
            sigkill_self_after(0.5)  # while this rank sleeps between agreement and exchange
            ep.dispatch(x, idx, w, num_experts, group=group)
        else:
            torch.cuda._sleep(20_000_000_000)  # ~10 s of this stream: its kernels wait
            if case == "ht_dispatch":
                sigkill_self_after(1.0)  # from outside: the dispatch blocks this thread
                ep.dispatch(x, idx, w, num_experts, group=group)
            else:
                sigkill_self_after(2.0)  # in case the call blocked, which it should not
                ep.low_latency_dispatch(x, idx, x.shape[0], num_experts, use_fp8=False,
                                        group=group)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached
        raise AssertionError("the victim survived SIGKILL")

    def failing_call() -> str:
        """Calls until one raises (at most two calls); returns the call that returned."""
        if case == "ll_dispatch":
            ld = ep.low_latency_dispatch(x, idx, x.shape[0], num_experts, use_fp8=False,
                                         group=group)  # fmt: skip
            start = time.monotonic()
            torch.cuda.synchronize()  # the kernel ends: with its timeout when the victim is gone
            out["ll_kernel_seconds"] = time.monotonic() - start
            ep.low_latency_combine(ld.recv_x, idx, w, ld.handle, group=group)
            return "low_latency_combine (the call after the dispatch)"
        ep.dispatch(x, idx, w, num_experts, group=group)
        if on_cuda:
            torch.cuda.synchronize()
        ep.dispatch(x, idx, w, num_experts, group=group)
        return "dispatch (the call after it)"

    call = _bounded(timing.raise_bound() + timing.step_bound, failing_call)
    out["call"] = {"returned": call["returned"], "seconds": call["seconds"],
                   "error": _describe(call["error"])}  # fmt: skip
    if not call["returned"]:
        return out
    if on_cuda:
        sync = _bounded(timing.step_bound, torch.cuda.synchronize)
        out["synchronize"] = {"returned": sync["returned"], "seconds": sync["seconds"],
                              "error": _describe(sync["error"])}  # fmt: skip
        if not sync["returned"]:
            return out
        later = _bounded(timing.step_bound, lambda: int(torch.arange(8, device=device).sum()))
        out["later_cuda_op"] = later["value"]
    aborted = _bounded(timing.step_bound + timing.group_timeout, lambda: ep.abort(group))
    out["abort"] = {"returned": aborted["returned"], "seconds": aborted["seconds"],
                    "error": _describe(aborted["error"])}  # fmt: skip
    if not aborted["returned"]:
        return out

    survivors = [r for r in range(world) if r != victim]

    def rebuild() -> dict[str, Any]:
        new = dist.new_group(ranks=survivors, backend="ep", use_local_synchronization=True,
                             timeout=datetime.timedelta(seconds=60))  # fmt: skip
        ref_group = dist.new_group(ranks=survivors, backend="gloo",
                                   use_local_synchronization=True)  # fmt: skip
        new_rank = survivors.index(rank)
        experts = 8 * len(survivors)
        found = {"mismatches": []}
        for step in range(2):
            found["mismatches"] += _round_trip(ep, ref, new, ref_group, new_rank, 100 + step,
                                               experts, device, on_cuda)  # fmt: skip
        if on_cuda:
            torch.cuda.synchronize()
            found["low_latency_transport"] = ep.get_backend(new).low_latency_transport
        return found

    rebuilt = _bounded(timing.step_bound + 60, rebuild)
    out["rebuild"] = {"returned": rebuilt["returned"], "seconds": rebuilt["seconds"],
                      "error": _describe(rebuilt["error"]), **(rebuilt["value"] or {})}  # fmt: skip
    return out


def check_survivors(run: Any, case: str, timing: Timing) -> list[str]:
    """Every property the issue asks of the survivors of ``run`` (a ``KilledRankRun``); the
    problems found, as strings (empty: all hold)."""
    problems: list[str] = []
    if run.victim_exitcode != -signal.SIGKILL:
        problems.append(f"victim {run.victim}: exit code {run.victim_exitcode}, not -SIGKILL")
    for rank, res in sorted(run.results.items()):

        def bad(what: str, rank: int = rank, res: dict = res) -> None:
            problems.append(f"rank {rank}: {what}: {res}")

        call = res.get("call", {})
        err = call.get("error")
        if not call.get("returned"):
            bad("its call hung (no exception within the bound)")
            continue
        if err is None:
            bad("its calls never raised although the victim was dead")
        else:
            if not err["timeout"]:
                bad(f"raised {err['type']}, not MoETimeoutError")
            if run.victim not in err["ranks"]:
                bad(f"exc.ranks {err['ranks']} do not name the victim {run.victim}")
            named = any(f"{words}" in err["message"] for words in (
                f"rank(s) {run.victim} never joined", f"rank(s) {run.victim} died",
                f"waiting for rank {run.victim}"))  # fmt: skip
            if not named:
                bad("the message does not name the victim's rank")
            if case == "ht_dispatch" and f"waiting for rank {run.victim}" not in err["message"]:
                bad("not a kernel timeout: the peers were not in the dispatch kernels")
        if case == "ll_dispatch" and res.get("ll_kernel_seconds", 0) < 0.8 * timing.kernel_timeout:
            bad("the low-latency dispatch kernel did not wait for the victim")
        if call["seconds"] > timing.raise_bound():
            bad(f"raised after {call['seconds']:.1f} s > {timing.raise_bound():.1f} s")
        if case not in CPU_CASES:
            if not res.get("synchronize", {}).get("returned"):
                bad("torch.cuda.synchronize() did not return: a kernel still spins")
            elif res.get("later_cuda_op") != 28:
                bad("a CUDA op after the failure did not work")
        abort = res.get("abort", {})
        if not abort.get("returned") or abort.get("error") is not None:
            bad("ep_backend.abort(group) hung or raised")
            continue
        rebuilt = res.get("rebuild", {})
        if not rebuilt.get("returned") or rebuilt.get("error") is not None:
            bad("the survivors' new group hung or raised")
        elif rebuilt.get("mismatches"):
            bad("the survivors' new group is not exact against the reference")
        if run.exitcodes.get(rank) != 0:
            bad(f"did not exit cleanly: exit code {run.exitcodes.get(rank)} (None: hung in "
                "teardown and killed)")  # fmt: skip
    return problems


def summary(run: Any) -> str:
    """One line per survivor: what it raised and how long each step took (for the logs)."""
    lines = [f"victim {run.victim}: exit code {run.victim_exitcode}"]
    for rank, res in sorted(run.results.items()):
        call = res.get("call", {})
        err = call.get("error") or {}

        def secs(step: str, res: dict = res) -> str:
            value = res.get(step, {}).get("seconds")
            return "-" if value is None else f"{value:.2f}s"

        lines.append(
            f"rank {rank}: raised {err.get('type')} ranks={err.get('ranks')} after "
            f"{secs('call')}; ll_kernel={res.get('ll_kernel_seconds', '-')}; sync {secs('synchronize')}; "
            f"abort {secs('abort')}; rebuild {secs('rebuild')} "
            f"mismatches={len(res.get('rebuild', {}).get('mismatches') or [])} "
            f"ll_transport_after={res.get('rebuild', {}).get('low_latency_transport', '-')!r}; "
            f"exit code {run.exitcodes.get(rank)} after {run.exit_seconds.get(rank, float('nan')):.2f}s; "
            f"message: {err.get('message', '')[:300]!r}"
        )
    return "\n".join(lines)
