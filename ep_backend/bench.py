"""Benchmark of the ep MoE collectives against the NCCL/Gloo all-to-all pipeline.

``python -m ep_backend.bench`` runs on every local GPU (one process each) if there are any, else on
two local CPU processes (small default shape). It prints, per op, the median time (µs; CUDA events
with the L2 cache flushed before every timed call, the max over ranks), remote GB/s (bytes that
leave the GPU) and logical GB/s (all received rows × row bytes, local ones included), and, in the
same run, the Megatron-style baseline: count exchange + host sync + permute + ``all_to_all_single``
+ unpermute, both directions. On GPUs the first rows are the physical limit of the same run: every
GPU pushing rows to all peers at once with the ops' SM budget (``Options.num_sms``) and with all
SMs (``ep_backend/_push_limit.py``); every HT row's "% limit" is its remote GB/s over the limit at
its SM budget. A loop row times layout + dispatch + combine queued for N steps with one sync,
next to the bound "dispatch + combine bytes at the limit". ``--sm-sweep`` times dispatch and
combine at num_sms 4..all SMs and prints the smallest count within 95% of each op's best. With
``--sweep`` it also times dispatch+combine over T and writes a PNG plot. A low-latency (decode)
section follows: dispatch (FP8, BF16) and combine latency of one call alone at
T=128, top-k of 16 experts (median of >= 200 calls on GPUs), an eager loop of FP8 dispatch + BF16
combine (µs per step, one sync at the end: what a decode loop waits for), hook-mode send/receive,
a CUDA-graph
replay of 16 calls when the NVSHMEM kernels are in use (timed after a host barrier, and again with
the GPUs in step: one untimed replay right before), and two ``all_to_all_single`` of the same rows
as the baseline; with ``--sweep`` also T = 1..256 (eager and graph rows, without hook mode). With
the NVSHMEM kernels, an LL row's remote GB/s is the bytes they put on the busiest GPU's link in one
direction (a dispatch message per token and destination rank with its header, a combine partial
per token and expert rank, the combine's weights, the flags: ``ep_backend/_ll_wire.py``) over its
time, and its "% limit" that over the push limit with all SMs (measured by the LL section when the
HT section did not run); the "ll bound" rows are each op's bytes at that limit, the least time the
link allows. Logical GB/s stays rows sent × row bytes; on CPU both columns are that.
Results go to ``--out`` as JSON. On 2 or more GPUs an all-to-all section follows
(``ep_backend/_bench_all_to_all.py``, off with ``--no-all-to-all``), at 2 ranks and at every GPU:
``all_to_all_single`` on ``ep`` (host splits), ``all_to_all_v`` (device splits), NCCL's
``all_to_all_single``, torch's ``symm_mem`` all_to_all_vdev where it runs and the push limit, per
size 4 KiB .. 256 MiB per peer, with ep's ratio to NCCL and to the limit, issue 42's targets, and
``bench_all_to_all.png`` / ``bench_all_to_all.json`` in ``--out``.

Standard-shape columns on GPUs: "time" is the op's GPU span with its launches queued ahead (the
host issues it while the GPU still runs a 1 ms busy kernel, the L2 flush and a one-element
all-reduce that puts the GPUs in step), as inside a model whose host runs ahead; it includes every
idle gap the op causes itself (a host wait before a launch, ranks waiting for each other). "call"
is the same op called on an idle GPU: it adds the host's work before the launches. "host" is the
host time of that call. GB/s use "time". A sample keeps the op's outputs until its end event is
recorded (a model goes on to use them; freeing them is not part of the op). EP_BENCH_HOST_TRACE=1
prints, per op, when the queued calls' hosts returned on the GPU's clock: a row whose time is
close to that is bound by the host, not the GPU. Each sample starts after a host barrier (the
ranks agree on a start time and spin until it); the "host barriers" line says how late the latest
rank left them: a late rank makes its peers' agreement wait, which "call" and "host" then hold;
the "MoE agreement" line names how that agreement step exchanged ("shared memory" on one host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from ep_backend._push_limit import PushLimitProbe

_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class Row:
    op: str
    tokens: int
    us: float
    host_us: float
    remote_gbps: float
    logical_gbps: float
    note: str = ""
    call_us: float = 0.0  # HT rows: the same op called with the GPU idle (0: not timed so)
    limit_pct: float = 0.0  # remote GB/s as % of the push limit at the ops' SM budget (0: none)
    num_sms: int = 0  # Options.num_sms the row ran with (0: not an SM-budget row)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routing(num_tokens: int, num_experts: int, topk: int, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device=device, generator=g)
    weights, idx = scores.topk(topk, dim=1)
    return idx, weights.float()


def host_us_per_call(fn: Callable[[], object], iters: int, skip: int = 0) -> float:
    """Median host time of one call of ``fn``, in µs: ``iters`` calls, each made on an idle device
    (synchronised first), the first ``skip`` of them left out of the median."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples[skip:])


def gpu_us_per_call(
    fn: Callable[[], object], iters: int, warmup: int = 0, in_step: bool = False
) -> float:
    """Mean GPU time of one call of ``fn``, in µs, over ``iters`` calls queued back to back.

    ``warmup`` untimed calls first; then the device is synchronised, the ranks of the default
    group meet at a barrier, and two CUDA events around the loop time it. The benchmarks under
    ``benchmarks/`` time their back-to-back rows with it.

    ``in_step``: one more untimed call between the barrier and the start event. For collectives
    whose kernels wait for every rank, the timed loop then starts when that call ends on this
    GPU, so the ranks are in step: without it, the first timed call also carries how far apart
    the ranks left the barrier and the first launch's latency, which a loop of a few calls of a
    large size (the all-to-all section times 5 from 64 MiB per peer) spreads over few calls.
    A host-bound op stays host-bound: the host is then at most one call ahead.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    if in_step:
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


class _Timer:
    """Median times of a callable: CUDA events (L2 flushed) on GPU, perf_counter on CPU."""

    # GPU busy time queued ahead of a "queued" sample: longer than the host needs to issue an op
    # (a dispatch issues its last kernel ~100-250 µs after it is called on this VM).
    _LEAD_US = 1000.0

    def __init__(
        self,
        device: torch.device,
        iters: int,
        warmup: int,
        gpu_sync: Callable[[], object] | None = None,
    ) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.gpu_sync = gpu_sync
        self.flush = (
            torch.empty(256 << 20, dtype=torch.uint8, device=device)
            if device.type == "cuda"
            else None
        )
        self.lead_cycles = self._calibrate_sleep() if device.type == "cuda" else 0
        # EP_BENCH_HOST_TRACE=1: when each queued call's host returned, in µs after its start
        # event on the GPU's clock (an event on an idle side stream maps host time onto it); a
        # row whose time is close to it is bound by the host, not the GPU. Printed per op.
        self.trace = os.environ.get("EP_BENCH_HOST_TRACE") == "1" and device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.trace else None
        self.host_end: list[float] = []

    def _calibrate_sleep(self) -> int:
        """Cycles of ``torch.cuda._sleep`` that keep this GPU busy for ``_LEAD_US``."""
        cycles = 1_000_000
        torch.cuda._sleep(cycles)  # first call: module load
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        us = max(start.elapsed_time(end) * 1e3, 1.0)
        return int(cycles * self._LEAD_US / us)

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(median time, median host time of the call alone), both µs, max over ranks.

        The GPU is idle when ``fn`` is called, so the time includes the host's work up to the
        op's last launch: what one call costs end to end on an otherwise idle GPU.
        """
        for _ in range(self.warmup):
            fn()
        samples, host = [], []
        for _ in range(self.iters):
            us, host_us = self._sample(fn, queued=False)
            samples.append(us)
            host.append(host_us)
        mine = torch.tensor([statistics.median(samples), statistics.median(host)],
                            dtype=torch.float64)  # fmt: skip
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # CPU tensor: Gloo, works on shared GPUs too
        return float(mine[0]), float(mine[1])

    def both(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        """(queued time, host time, call time), µs, medians, max over ranks; samples interleaved.

        Queued: the op is issued while the GPU still runs ``_LEAD_US`` of queued work, then the
        L2 flush, then (``gpu_sync``) a one-element all-reduce that puts the GPUs in step; the
        events time the op's own GPU span, including every GPU idle gap it causes itself (a host
        wait before a launch, the ranks waiting for each other) but not the host's work ahead of
        its first launch, which in a model overlaps the preceding GPU work. Call: as
        ``__call__``. On CPU both are wall time.
        """
        if self.flush is None:
            us, host_us = self(fn)
            return us, host_us, us
        for _ in range(self.warmup):
            fn()
        queued, host, call = [], [], []
        for _ in range(self.iters):
            queued.append(self._sample(fn, queued=True)[0])
            # Host time from the idle-GPU call: a queued call's host also waits out the lead.
            us, host_us = self._sample(fn, queued=False)
            call.append(us)
            host.append(host_us)
        mine = torch.tensor([statistics.median(v) for v in (queued, host, call)],
                            dtype=torch.float64)  # fmt: skip
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if self.trace:
            ends = sorted(self.host_end)
            print(f"  [host trace rank {dist.get_rank()}] queued {statistics.median(queued):.1f} "
                  f"us, host returned at {statistics.median(ends):.1f} (min {ends[0]:.1f}, "
                  f"max {ends[-1]:.1f})", flush=True)  # fmt: skip
            self.host_end.clear()
        return float(mine[0]), float(mine[1]), float(mine[2])

    def _sample(self, fn: Callable[[], object], queued: bool) -> tuple[float, float]:
        """One timed call: (time, host time of the call), µs."""
        # The op's outputs live until the sample is taken, as in a model that goes on to use
        # them: freeing them is not part of the op.
        if self.flush is None:
            _host_barrier()
            t0 = time.perf_counter()
            out = fn()
            us = (time.perf_counter() - t0) * 1e6
            del out
            return us, us
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            _host_barrier()
            torch.cuda._sleep(self.lead_cycles)
            self.flush.zero_()
            if self.gpu_sync is not None:
                self.gpu_sync()
        else:
            self.flush.zero_()
            _host_barrier()
        start.record()
        mark = None
        if queued and self.trace:
            mark = torch.cuda.Event(enable_timing=True)
            m0 = time.monotonic_ns()
            mark.record(self.side)
        h0 = time.perf_counter()
        out = fn()
        host_us = (time.perf_counter() - h0) * 1e6
        if mark is not None:
            m1 = time.monotonic_ns()
        end.record()
        end.synchronize()
        del out
        if mark is not None:
            mark.synchronize()
            self.host_end.append(start.elapsed_time(mark) * 1e3 + (m1 - m0) / 1e3)
        return start.elapsed_time(end) * 1e3, host_us

    def loop(self, step: Callable[[], object], steps: int) -> tuple[float, float, float]:
        """A loop of ``steps`` calls of ``step`` with one sync at the end: (time, host, call) per
        step, µs, medians over samples, max over ranks.

        What a training or decode loop waits for: the host issues step k+1 while the GPU still runs
        step k, so neither the host's launch work nor the ranks' skew at the start is paid per
        step, only once per loop. Each sample starts after a host barrier and (``gpu_sync``) with
        the GPUs in step. time: GPU span of the loop (events) / steps; host: the host's time to
        issue the loop / steps; call: wall time until the end sync returned / steps. On CPU all
        three are wall time.
        """
        for _ in range(self.warmup):
            step()
        samples = max(3, min(self.iters, 7))
        times, hosts, calls = [], [], []
        for _ in range(samples):
            _host_barrier()
            if self.flush is None:
                h0 = time.perf_counter()
                for _ in range(steps):
                    step()
                wall = (time.perf_counter() - h0) * 1e6 / steps
                times.append(wall)
                hosts.append(wall)
                calls.append(wall)
                continue
            if self.gpu_sync is not None:
                self.gpu_sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            for _ in range(steps):
                step()
            h1 = time.perf_counter()
            end.record()
            end.synchronize()
            h2 = time.perf_counter()
            times.append(start.elapsed_time(end) * 1e3 / steps)
            hosts.append((h1 - h0) * 1e6 / steps)
            calls.append((h2 - h0) * 1e6 / steps)
        mine = torch.tensor([statistics.median(v) for v in (times, hosts, calls)],
                            dtype=torch.float64)  # fmt: skip
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine[0]), float(mine[1]), float(mine[2])

    def aligned(self, replay: Callable[[], object]) -> float:
        """Median time of ``replay()`` when it starts with the GPUs in step (µs, max over ranks).

        ``replay`` must synchronise the ranks' GPUs by itself (e.g. a graph of collectives). It
        runs once untimed right before the timed run: the ranks leave the host barrier a few µs
        apart (more when a host is descheduled), and their launches differ too; without this the
        earliest rank's timed run would include that gap.
        """
        assert self.flush is not None, "GPU only"
        for _ in range(self.warmup):
            replay()
        samples = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _host_barrier()
            replay()
            start.record()
            replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        mine = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine[0])

    def split(
        self, first: Callable[[], Any], second: Callable[[Any], object]
    ) -> tuple[tuple[float, float], tuple[float, float]]:
        """Times ``r = first()`` and then ``second(r)`` separately (e.g. send, then recv hook)."""
        for _ in range(self.warmup):
            second(first())
        samples: tuple[list[float], list[float], list[float], list[float]] = ([], [], [], [])
        for _ in range(self.iters):
            if self.flush is not None:
                self.flush.zero_()
            _host_barrier()
            if self.flush is not None:
                events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                events[0].record()
            h0 = time.perf_counter()
            r = first()
            h1 = time.perf_counter()
            if self.flush is not None:
                events[1].record()
            second(r)
            h2 = time.perf_counter()
            if self.flush is not None:
                events[2].record()
                events[2].synchronize()
                samples[0].append(events[0].elapsed_time(events[1]) * 1e3)
                samples[1].append(events[1].elapsed_time(events[2]) * 1e3)
            else:
                samples[0].append((h1 - h0) * 1e6)
                samples[1].append((h2 - h1) * 1e6)
            samples[2].append((h1 - h0) * 1e6)
            samples[3].append((h2 - h1) * 1e6)
        mine = torch.tensor([statistics.median(v) for v in samples], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return (float(mine[0]), float(mine[2])), (float(mine[1]), float(mine[3]))


# How far ahead of the latest rank's clock the ranks agree to start: more than the all-reduce that
# agrees on it takes to return everywhere, or a rank still inside it starts late (and its peers'
# next agreement waits for it). Three times the all-reduce this rank last saw, within bounds.
_MIN_AHEAD_NS = 500_000
_MAX_AHEAD_NS = 10_000_000
_ahead_ns = _MIN_AHEAD_NS
# Per barrier, how late this rank left it: ns after the agreed start (0: it waited for the start).
_late_ns: list[int] = []


def _host_barrier() -> None:
    """Lines the ranks' hosts up (over Gloo: no CUDA communicator, fine when ranks share a GPU).

    The ranks all-reduce a start time ahead on CLOCK_MONOTONIC, which the processes of one host
    share, and each spins until it: they leave within a few µs of each other instead of with the
    all-reduce's own exit skew. A start time far off (clocks of different hosts) is not waited
    for. How late each rank left is kept for :func:`_barrier_lateness`.
    """
    global _ahead_ns
    entered = time.monotonic_ns()
    start = torch.tensor([entered + _ahead_ns], dtype=torch.int64)
    dist.all_reduce(start, op=dist.ReduceOp.MAX)
    returned = time.monotonic_ns()
    _ahead_ns = min(_MAX_AHEAD_NS, max(_MIN_AHEAD_NS, 3 * (returned - entered)))
    deadline = int(start.item())
    if deadline - returned <= 2 * _MAX_AHEAD_NS:
        while time.monotonic_ns() < deadline:
            pass
        _late_ns.append(max(0, returned - deadline))


def _barrier_lateness() -> tuple[float, float, int]:
    """(median, max) µs by which a rank left a host barrier after the agreed start, the worst rank
    of the group, and the number of barriers (collective)."""
    late = _late_ns or [0]
    mine = torch.tensor([statistics.median(late) / 1e3, max(late) / 1e3], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine[0]), float(mine[1]), len(_late_ns)


# num_sms settings of --sm-sweep (capped at the device's SM count, which is always included).
SM_SWEEP = (4, 8, 12, 16, 20, 24, 32, 48, 64, 96, 132)


def sm_sweep_counts(sm_count: int) -> list[int]:
    """The SM budgets ``--sm-sweep`` times on a device of ``sm_count`` SMs, ascending."""
    if sm_count < 1:
        raise ValueError(f"sm_count {sm_count}: must be at least 1")
    return sorted({n for n in SM_SWEEP if n < sm_count} | {sm_count})


def smallest_sms_reaching(rows: list[dict], op: str, fraction: float = 0.95
                          ) -> tuple[int, int, float] | None:  # fmt: skip
    """(smallest num_sms whose time is within ``fraction`` of the best, best num_sms, best µs).

    ``rows``: bench rows (dicts) of one op at several ``num_sms``; "within" means throughput:
    ``best_us / us >= fraction``. None when ``op`` has no timed row.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction}: must be in (0, 1]")
    timed = sorted((r["num_sms"], r["us"]) for r in rows if r["op"] == op and r["us"] > 0)
    if not timed:
        return None
    best_sms, best_us = min(timed, key=lambda t: (t[1], t[0]))
    smallest = next(n for n, us in timed if best_us / us >= fraction)
    return smallest, best_sms, best_us


def _open_push_limit_probe(
    args: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
    store: dist.Store,
    shared_gpus: bool,
) -> tuple[PushLimitProbe | None, str]:
    """This rank's push-limit probe, or (None, why it cannot run)."""
    if device.type != "cuda":
        return None, "needs GPUs (one per rank)"
    if shared_gpus:
        return None, "ranks share a GPU (not a link figure)"
    if world < 2:
        return None, "needs at least 2 ranks"
    from ep_backend._push_limit import MAX_PEERS, open_on_every_rank

    if world > MAX_PEERS + 1:
        return None, f"{world} ranks: the probe pushes to at most {MAX_PEERS} peers"
    if not args.probe_lib:
        return None, args.probe_reason
    probe, why = open_on_every_rank(
        Path(args.probe_lib),
        store,
        "ep_bench/push_limit",
        rank,
        world,
        device,
        args.hidden * 2,
        64 << 20,
        torch.device("cpu"),
    )
    if why:
        print(f"push limit: {why}", flush=True)
    return probe, why


def _nccl_pipeline(x, idx, weights, num_experts: int, group) -> Callable[[], torch.Tensor]:
    """Megatron-style all-to-all dispatcher (permute, a2a, unpermute; then the way back)."""
    num_ranks = dist.get_world_size(group)
    experts_per_rank = num_experts // num_ranks
    num_tokens, topk = idx.shape

    def run() -> torch.Tensor:
        # dispatch: one row per (token, expert), grouped by destination rank then local expert
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=num_experts)
        send_counts = per_expert.view(num_ranks, experts_per_rank).sum(1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=group)
        send_list, recv_list = send_counts.tolist(), recv_counts.tolist()  # host sync
        permuted = x.index_select(0, order // topk)
        received = x.new_empty((sum(recv_list), x.shape[1]))
        dist.all_to_all_single(received, permuted, recv_list, send_list, group=group)
        # unpermute on the expert side: source-rank-major -> local-expert-major
        rpe = recv_per_expert.view(num_ranks, experts_per_rank)
        seg = torch.arange(rpe.numel(), device=x.device).view(num_ranks, experts_per_rank)
        seg_of_row = torch.repeat_interleave(seg.reshape(-1), rpe.reshape(-1))
        expert_major = torch.argsort(
            seg_of_row % experts_per_rank * num_ranks + seg_of_row // experts_per_rank, stable=True
        )
        expert_input = received.index_select(0, expert_major)
        # combine: the way back, then a weighted sum per token
        back = torch.empty_like(received)
        back.index_copy_(0, expert_major, expert_input)
        returned = x.new_empty((sum(send_list), x.shape[1]))
        dist.all_to_all_single(returned, back, send_list, recv_list, group=group)
        out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        w = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        out.index_add_(0, order // topk, returned.float() * w)
        return out.to(x.dtype)

    return run


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, result_path: str) -> None:
    os.environ.update(_ENV)
    import ep_backend as ep

    use_cuda = torch.cuda.is_available() and not args.cpu
    gpus = torch.cuda.device_count() if use_cuda else 0
    # More ranks than GPUs: ranks share GPUs (the NVLink path then runs over CUDA IPC inside a
    # device, and NCCL, hence the baseline, cannot run). Useful for host-overhead profiling only.
    shared_gpus = use_cuda and world > gpus
    device = torch.device("cuda", rank % gpus) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:  # one process per core share: oversubscribed intra-op threads cost more than they save
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=300))  # fmt: skip
    dist.init_process_group("ep", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    group = dist.group.WORLD
    # A one-element all-reduce (NCCL) lines the GPUs up before a queued sample; not where ranks
    # share a GPU (NCCL needs one per rank).
    sync_token = torch.zeros(1, device=device) if use_cuda and not shared_gpus else None
    gpu_sync = (lambda: dist.all_reduce(sync_token)) if sync_token is not None else None
    timer = _Timer(device, args.iters, args.warmup, gpu_sync)
    # low latency: the median of >= 200 calls on GPUs (they are short)
    ll_timer = _Timer(device, max(args.iters, 200) if use_cuda else args.iters, args.warmup,
                      gpu_sync)  # fmt: skip
    hidden, topk, num_experts = args.hidden, args.topk, args.experts
    rows: list[Row] = []
    ep_options = ep.get_backend(group).options
    if args.num_sms:
        ep_options.num_sms = args.num_sms
    budget = int(ep_options.num_sms)  # the ops' SM budget: the limit's "%" column reads against it
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if use_cuda else 0
    probe, probe_why = _open_push_limit_probe(args, rank, world, device, store, shared_gpus)

    def push_limit(num_sms: int) -> tuple[float, float]:
        """(µs per launch, GB/s per GPU per direction), every GPU pushing to all peers at once."""
        assert probe is not None and gpu_sync is not None
        launches = 10
        for _ in range(args.warmup):
            probe.launch(num_sms)
        samples = []
        for _ in range(max(5, min(args.iters, 10))):
            _host_barrier()
            gpu_sync()  # the GPUs start in step: every link carries traffic both ways at once
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(launches):
                probe.launch(num_sms)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / launches)
        mine = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # as slow as the slowest GPU
        us = float(mine[0])
        return us, probe.bytes_per_launch / us / 1e3

    limit: dict[int, float] = {}  # num_sms -> GB/s, measured once per run
    limit_us: dict[int, float] = {}  # num_sms -> µs per launch of the limit's push

    def measure_limit(num_tokens: int) -> None:
        """The limit rows: all GPUs push to all peers, with the ops' SM budget and all SMs."""
        settings = [(budget, f"{budget} SMs (Options.num_sms)")]
        if sm_count and sm_count != budget:
            settings.append((sm_count, f"all {sm_count} SMs"))
        if probe is None:
            rows.append(Row("limit: push to all peers", num_tokens, 0.0, 0.0, 0.0, 0.0,
                            f"not run: {probe_why}"))  # fmt: skip
            return
        for num_sms, label in settings:
            us, gbps = push_limit(num_sms)
            limit[num_sms], limit_us[num_sms] = gbps, us
            mib = probe.bytes_per_launch / 2**20
            rows.append(Row(f"limit: push to all peers, {label}", num_tokens, us, 0.0, gbps, gbps,
                            f"every GPU pushes {mib:.0f} MiB to its {world - 1} peer(s) at once",
                            limit_pct=100.0 if num_sms == budget else 0.0,
                            num_sms=num_sms))  # fmt: skip

    def pct_of(gbps: float, num_sms: int) -> float:
        return 100.0 * gbps / limit[num_sms] if limit.get(num_sms) and gbps else 0.0

    def measure(num_tokens: int, full: bool) -> None:
        x = torch.randn(num_tokens, hidden, device=device).bfloat16()
        idx, weights = _routing(num_tokens, num_experts, topk, device, seed=rank)
        layout = ep.get_dispatch_layout(idx, num_experts)
        remote_rows = int(layout.num_tokens_per_rank.sum() - layout.num_tokens_per_rank[rank])
        out = ep.dispatch(x, idx, weights, num_experts)
        recv_rows = out.recv_x.shape[0]
        # Warm-up beyond the timer's own, before the first op a process times (clocks,
        # allocator, page mappings): a precaution, so the first timed row is not the slowest.
        for _ in range(10 * args.warmup if use_cuda else 0):
            warm = ep.dispatch(x, idx, weights, num_experts)
            ep.combine(warm.recv_x, warm.handle)
        # the baseline moves one row per (token, expert) instead of one per (token, rank)
        remote_entries = int((idx // (num_experts // world) != rank).sum())
        counts = torch.tensor([remote_rows, recv_rows, remote_entries], dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        remote_rows, recv_rows, remote_entries = (int(c) for c in counts.tolist())
        row_bf16 = hidden * 2
        row_fp8 = hidden + hidden // 128 * 4

        def add(op: str, t: tuple[float, float, float], row_bytes: int, remote: int,
                logical: int, note: str = "", sm_row: bool = False,
                pct: bool = True) -> None:  # fmt: skip
            # pct=False: not an ep op (the NCCL baseline has its own channels, not ep's SMs).
            us, host_us, call_us = t
            remote_gbps = remote * row_bytes / us / 1e3 if us else 0.0
            rows.append(Row(op, num_tokens, us, host_us, remote_gbps,
                            logical * row_bytes / us / 1e3 if us else 0.0, note, call_us,
                            pct_of(remote_gbps, int(ep_options.num_sms)) if pct else 0.0,
                            int(ep_options.num_sms) if sm_row else 0))  # fmt: skip

        t_dispatch = timer.both(lambda: ep.dispatch(x, idx, weights, num_experts))
        # Combine (and cached dispatch below) follow their own dispatch, as in a model: the group
        # keeps the routing of its last few dispatches, which they then reuse.
        out = ep.dispatch(x, idx, weights, num_experts)
        y = out.recv_x
        t_combine = timer.both(lambda: ep.combine(y, out.handle))
        t_both = (t_dispatch[0] + t_combine[0], t_dispatch[1] + t_combine[1],
                  t_dispatch[2] + t_combine[2])  # fmt: skip
        add("ep dispatch+combine BF16", t_both, row_bf16, 2 * remote_rows, 2 * recv_rows)
        if shared_gpus:
            rows.append(Row("baseline a2a pipeline (both ways)", num_tokens, 0.0, 0.0, 0.0, 0.0,
                            "not run: ranks share a GPU (NCCL needs one per rank)"))  # fmt: skip
        else:
            t_base = timer.both(_nccl_pipeline(x, idx, weights, num_experts, group))
            idle = f" ({t_base[2] / t_both[2]:.2f}x called on an idle GPU)" if use_cuda else ""
            add("baseline a2a pipeline (both ways)", t_base, row_bf16, 2 * remote_entries, 0,
                f"ep is {t_base[0] / t_both[0]:.2f}x faster{idle}", pct=False)  # fmt: skip
        if not full:
            return
        x8, s8 = ep.reference.quantize_fp8_per128(x)
        t_layout = timer.both(lambda: ep.get_dispatch_layout(idx, num_experts))
        # As DeepEP's dispatch, given the layout (its own row above); and computing it itself.
        t_given = timer.both(lambda: ep.dispatch(x, idx, weights, num_experts, layout=layout))
        t_fp8 = timer.both(
            lambda: ep.dispatch(x8, idx, weights, num_experts, x_scales=s8, layout=layout)
        )
        t_fp8_own = timer.both(lambda: ep.dispatch(x8, idx, weights, num_experts, x_scales=s8))
        out = ep.dispatch(x, idx, weights, num_experts)
        t_cached = timer.both(lambda: ep.dispatch(x, handle=out.handle))
        # The receive-buffer path (on GPUs: the receivers copy rows out of the buffer): a dispatch
        # finding every receive slab lent, as in a training step holding more layers' outputs
        # than Options.recv_slabs; and worst-case mode (no host sync; CUDA graphs).
        num_slabs = int(os.environ.get("EP_RECV_SLABS", ep.get_backend(group).options.recv_slabs))
        held = [ep.dispatch(x, idx, weights, num_experts, layout=layout) for _ in range(num_slabs)]
        t_no_slab = timer.both(lambda: ep.dispatch(x, idx, weights, num_experts, layout=layout))
        del held
        worst = num_tokens * world  # every token of every rank: covers any receive
        t_worst = timer.both(
            lambda: ep.dispatch(x, idx, weights, num_experts, layout=layout, num_worst_tokens=worst)
        )
        add("ep layout", t_layout, 0, 0, 0)
        if use_cuda:  # what this timer gives the smallest op: one launch of a 1-element kernel
            tiny = torch.zeros(1, device=device)
            add("floor: one tiny torch kernel", timer.both(tiny.zero_), 0, 0, 0,
                "launch latency + host overhead of this timer")  # fmt: skip
        add("ep dispatch BF16", t_given, row_bf16, remote_rows, recv_rows,
            "layout= from get_dispatch_layout (DeepEP's contract)")  # fmt: skip
        add("ep dispatch BF16, own layout", t_dispatch, row_bf16, remote_rows, recv_rows,
            "layout computed inside (as in dispatch+combine)")  # fmt: skip
        add("ep dispatch BF16, slabs all held", t_no_slab, row_bf16, remote_rows, recv_rows,
            f"{num_slabs} earlier outputs alive: receive-buffer path (training)")  # fmt: skip
        add("ep dispatch BF16, worst-case", t_worst, row_bf16, remote_rows, recv_rows,
            f"num_worst_tokens={worst}: no host sync (CUDA graphs), buffer path")  # fmt: skip
        if use_cuda:  # the same dispatch with the kernel launched after the host wait
            options = ep.get_backend(group).options
            options.overlap_dispatch_host_wait = False
            t_host_first = timer.both(lambda: ep.dispatch(x, idx, weights, num_experts))
            options.overlap_dispatch_host_wait = True
            add("ep dispatch BF16, host-first", t_host_first, row_bf16, remote_rows, recv_rows,
                "Options(overlap_dispatch_host_wait=False)")  # fmt: skip
        add("ep dispatch FP8", t_fp8, row_fp8, remote_rows, recv_rows,
            "layout= from get_dispatch_layout (DeepEP's contract)")  # fmt: skip
        add("ep dispatch FP8, own layout", t_fp8_own, row_fp8, remote_rows, recv_rows)
        add("ep cached dispatch BF16", t_cached, row_bf16, remote_rows, recv_rows)
        add("ep combine BF16", t_combine, row_bf16, remote_rows, recv_rows)

        # What a training loop waits for: N steps queued back to back, one sync at the end (the
        # dispatch's own host wait for the counts stays inside each step, as in a model).
        def ht_step() -> object:
            step_layout = ep.get_dispatch_layout(idx, num_experts)
            d = ep.dispatch(x, idx, weights, num_experts, layout=step_layout)
            return ep.combine(d.recv_x, d.handle)

        steps = args.iters
        t_loop = timer.loop(ht_step, steps)
        loop_note = f"loop of {steps} steps, one sync at the end; µs per step"
        if limit.get(budget):
            bound_us = 2 * remote_rows * row_bf16 / limit[budget] / 1e3
            loop_note += f"; {t_loop[0] / bound_us:.3f}x the bound (target <= 1.05x)"
            rows.append(Row("bound: dispatch + combine bytes at the limit", num_tokens, bound_us,
                            0.0, limit[budget], limit[budget],
                            f"{2 * remote_rows} remote rows x {row_bf16} B at the {budget}-SM "
                            "limit", limit_pct=100.0))  # fmt: skip
        else:
            rows.append(Row("bound: dispatch + combine bytes at the limit", num_tokens, 0.0, 0.0,
                            0.0, 0.0, f"not run: {probe_why}"))  # fmt: skip
        add("ep loop: layout + dispatch + combine BF16", t_loop, row_bf16, 2 * remote_rows,
            2 * recv_rows, loop_note)  # fmt: skip
        if args.sm_sweep:
            measure_sm_sweep(num_tokens, x, idx, weights, layout, add, remote_rows, recv_rows)

    def measure_sm_sweep(
        num_tokens: int,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        layout: Any,
        add: Callable[..., None],
        remote_rows: int,
        recv_rows: int,
    ) -> None:
        """Dispatch and combine (HT, BF16) at each SM budget; Options.num_sms applies per call."""
        if not use_cuda or shared_gpus:
            why = "needs GPUs (one per rank)" if not use_cuda else "ranks share a GPU"
            rows.append(Row("sm sweep", num_tokens, 0.0, 0.0, 0.0, 0.0, f"not run: {why}"))
            return
        row_bf16 = hidden * 2
        for num_sms in sm_sweep_counts(sm_count):
            ep_options.num_sms = num_sms  # every rank alike; read by the next call
            if probe is not None and num_sms not in limit:
                limit_us[num_sms], limit[num_sms] = push_limit(num_sms)
            if probe is not None:
                rows.append(Row("sm sweep: push limit", num_tokens, limit_us[num_sms], 0.0,
                                limit[num_sms], limit[num_sms], limit_pct=100.0,
                                num_sms=num_sms))  # fmt: skip
            t_d = timer.both(lambda: ep.dispatch(x, idx, weights, num_experts, layout=layout))
            handed = ep.dispatch(x, idx, weights, num_experts, layout=layout)

            def combine_handed(d: ep.DispatchOutput = handed) -> object:
                return ep.combine(d.recv_x, d.handle)

            t_c = timer.both(combine_handed)
            add("sm sweep: dispatch BF16", t_d, row_bf16, remote_rows, recv_rows, sm_row=True)
            add("sm sweep: combine BF16", t_c, row_bf16, remote_rows, recv_rows, sm_row=True)
        ep_options.num_sms = budget

    def ll_wire_rows(idx: torch.Tensor, ll_experts: int, num_tokens: int,
                     transport: str) -> dict[str, int] | None:  # fmt: skip
        """The LL ops' link bytes (max over GPUs and directions; ``ep_backend/_ll_wire.py``)
        by op ("fp8", "bf16", "combine", "pair" = FP8 dispatch + combine), None off the NVSHMEM
        kernels; adds the push limit with all SMs when no section measured it yet, and the "ll
        bound" rows: each op's bytes at that limit. Collective."""
        from ep_backend._ll_wire import LLWire, ll_link_bytes, ll_wire_bytes

        ops = (("fp8", "dispatch FP8"), ("bf16", "dispatch BF16"), ("combine", "combine BF16"),
               ("pair", "dispatch FP8 + combine BF16"),
               ("combine_bf16p", "combine BF16, BF16 partials"),
               ("pair_bf16p", "dispatch FP8 + combine BF16, BF16 partials"))  # fmt: skip

        def bound_op(name: str) -> str:
            return f"ll bound: {name} wire bytes at the limit (all SMs)"

        if transport != "nvshmem":
            for _, name in ops:
                rows.append(Row(bound_op(name), num_tokens, 0.0, 0.0, 0.0, 0.0,
                                f"not run: the wire bytes are the NVSHMEM kernels'; the "
                                f"low-latency transport is {transport}"))  # fmt: skip
            return None
        # Every rank's share of the traffic (what its tokens send and get back, per peer): what
        # one GPU sends in a combine and receives in a dispatch depends on its peers' routing.
        # (Options.low_latency_combine_bf16_partials: index 1.)
        shares = torch.zeros(2, world, 4, world, dtype=torch.int64)
        for i, bf16_partials in enumerate((False, True)):
            shares[i, rank] = ll_wire_bytes(idx, ll_experts, world, rank, hidden,
                                            bf16_partials=bf16_partials).as_tensor()  # fmt: skip
        dist.all_reduce(shares)  # CPU tensor: Gloo; only row `rank` of each rank is non-zero
        link, halved = (ll_link_bytes([LLWire.from_tensor(r, shares[i, r]) for r in range(world)])
                        for i in range(2))  # fmt: skip
        loads = {"fp8": link.dispatch_fp8, "bf16": link.dispatch_bf16, "combine": link.combine,
                 "combine_bf16p": halved.combine}  # fmt: skip
        wire = {op: load.bound_bytes for op, load in loads.items()}
        where = {op: load.busiest for op, load in loads.items()}
        for pair, combine in (("pair", "combine"), ("pair_bf16p", "combine_bf16p")):
            # one after the other: the bounds add up
            wire[pair] = wire["fp8"] + wire[combine]
            where[pair] = f"FP8 dispatch's {where['fp8']} + combine's {where[combine]}"
        if probe is not None and sm_count not in limit:  # --no-high-throughput: not yet measured
            limit_us[sm_count], limit[sm_count] = push_limit(sm_count)
            mib = probe.bytes_per_launch / 2**20
            rows.append(Row(f"ll limit: push to all peers, all {sm_count} SMs", num_tokens,
                            limit_us[sm_count], 0.0, limit[sm_count], limit[sm_count],
                            f"every GPU pushes {mib:.0f} MiB to its {world - 1} peer(s) at once",
                            num_sms=sm_count))  # fmt: skip
        for op, name in ops:
            mb = wire[op] / 1e6
            if not limit.get(sm_count):
                rows.append(Row(bound_op(name), num_tokens, 0.0, 0.0, 0.0, 0.0,
                                f"not run: {probe_why}; {mb:.3f} MB ({where[op]})"))  # fmt: skip
                continue
            gbps = limit[sm_count]
            rows.append(Row(bound_op(name), num_tokens, wire[op] / gbps / 1e3, 0.0, gbps, gbps,
                            f"{mb:.3f} MB ({where[op]}) at the {sm_count}-SM push limit",
                            limit_pct=100.0))  # fmt: skip
        return wire

    def measure_low_latency(num_tokens: int, full: bool) -> None:
        """Decode shape: dispatch/combine latency, eager and (when capturable) graph-replayed."""
        m, ll_experts = args.ll_max_tokens, args.ll_experts
        x = torch.randn(num_tokens, hidden, device=device).bfloat16()
        idx, weights = _routing(num_tokens, ll_experts, topk, device, seed=rank + 100)
        d = ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=False)
        y = d.recv_x
        entries = int((idx >= 0).sum())  # rows this rank sends (one per token and expert)
        counts = torch.tensor([entries], dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        entries = int(counts[0])
        row_bf16, row_fp8 = hidden * 2, hidden + hidden // 128 * 4
        transport = ep.get_backend().low_latency_transport if use_cuda else "aten (CPU)"
        # GPUs: the bytes the NVSHMEM kernels put on the busiest GPU's link per op (one
        # direction, the slowest GPU bounds the op), read against the push limit with all SMs.
        wire = ll_wire_rows(idx, ll_experts, num_tokens, transport) if use_cuda else None

        def add(op: str, t: tuple[float, float], row_bytes: int, note: str = "",
                call_us: float = 0.0, wire_bytes: int | None = None,
                pct: bool = True) -> None:  # fmt: skip
            # wire_bytes: the op's link bytes (remote GB/s and, unless pct=False, % limit read
            # them); None: on CPU and off the NVSHMEM kernels, remote GB/s stays the logical one.
            us, host_us = t
            if us <= 0:  # a difference of two timings (combine = pair - dispatch) within noise
                us, note = 0.0, note + "; not measured: the pair was no slower than the dispatch"
            gbps = entries * row_bytes / us / 1e3 if us else 0.0
            remote = gbps
            if wire_bytes is not None:
                remote = wire_bytes / us / 1e3 if us else 0.0
            rows.append(Row(op, num_tokens, us, host_us, remote, gbps, note, call_us,
                            pct_of(remote, sm_count) if wire_bytes is not None and pct
                            else 0.0))  # fmt: skip

        def wire_of(op: str) -> int | None:
            return wire[op] if wire is not None else None

        # "time" as in the HT rows: queued behind a busy GPU with the GPUs in step, so the span
        # holds the kernels and the gaps they cause, not the host's launch work. "call": one call
        # alone on an idle GPU right after a host barrier; its span also holds the call's host
        # launch work and the ranks' start skew, which a loop pays once, not per call. A combine
        # needs its own dispatch first: its "time" is the queued pair minus the FP8 dispatch, its
        # "call" and "host" come from the pair timed apart within each iteration.
        def ll_fp8() -> ep.LowLatencyDispatchOutput:
            return ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=True)

        def ll_pair() -> object:
            return ep.low_latency_combine(y, idx, weights, ll_fp8().handle)

        q_fp8 = ll_timer.both(ll_fp8)
        q_bf16 = ll_timer.both(
            lambda: ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=False)
        )
        q_pair = ll_timer.both(ll_pair)
        _, t_comb = ll_timer.split(ll_fp8, lambda dd: ep.low_latency_combine(y, idx, weights,
                                                                             dd.handle))  # fmt: skip
        note = f"{transport}; time: queued, GPUs in step; call: alone on an idle GPU"
        if not use_cuda:
            note = transport
        add("ll dispatch FP8", q_fp8[:2], row_fp8, note, q_fp8[2] if use_cuda else 0.0,
            wire_of("fp8"))  # fmt: skip
        add("ll dispatch BF16", q_bf16[:2], row_bf16, note, q_bf16[2] if use_cuda else 0.0,
            wire_of("bf16"))  # fmt: skip
        comb_us = q_pair[0] - q_fp8[0] if use_cuda else t_comb[0]
        add("ll combine BF16", (comb_us, t_comb[1]), row_bf16,
            note + (" (time: pair - FP8 dispatch)" if use_cuda else ""),
            t_comb[0] if use_cuda else 0.0, wire_of("combine"))  # fmt: skip

        # What a decode loop waits for: eager steps queued back to back, one sync at the end.
        def ll_step() -> object:
            dd = ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=True)
            return ep.low_latency_combine(y, idx, weights, dd.handle)

        steps = 100 if use_cuda else 10
        loop_note = f"{transport}; eager loop of {steps} steps, one sync at the end; µs per step"
        t_loop, host_loop, wall_loop = ll_timer.loop(ll_step, steps)
        add("ll dispatch FP8 + combine BF16", (t_loop, host_loop), row_fp8 + row_bf16,
            loop_note, wall_loop if use_cuda else 0.0, wire_of("pair"))  # fmt: skip
        # The same loop with each rank's sums returned as BF16 (half the combine's bytes): the
        # option is read per call, so it is set around the loop only.
        with _bf16_partials():
            t_loop, host_loop, wall_loop = ll_timer.loop(ll_step, steps)
        add("ll dispatch FP8 + combine BF16, BF16 partials", (t_loop, host_loop),
            row_fp8 + row_bf16, loop_note + "; Options.low_latency_combine_bf16_partials",
            wall_loop if use_cuda else 0.0, wire_of("pair_bf16p"))  # fmt: skip
        if full:
            measure_hook_mode(x, idx, m, ll_experts, add, transport, row_fp8, wire)
        if use_cuda and transport == "nvshmem":  # decode runs under CUDA graphs
            measure_graphs(x, y, idx, weights, m, ll_experts, add, transport, row_fp8, row_bf16,
                           wire)  # fmt: skip
        if not shared_gpus:  # baseline: the same rows through one all_to_all_single
            per_rank = torch.full((world,), entries // world + 1, dtype=torch.int64)
            send = torch.empty(int(per_rank.sum()) * row_bf16 // 2, dtype=torch.bfloat16,
                               device=device)  # fmt: skip
            recv = torch.empty_like(send)

            def a2a() -> None:
                dist.all_to_all_single(recv, send)
                dist.all_to_all_single(send, recv)

            # GPUs: remote GB/s = the rows to the peers (NCCL: not ep's kernels, no % limit).
            a2a_wire = 2 * (world - 1) * (entries // world + 1) * row_bf16 if use_cuda else None
            add("baseline all_to_all_single x2 (BF16 rows)", ll_timer(a2a), 2 * row_bf16,
                wire_bytes=a2a_wire, pct=False)  # fmt: skip

    def measure_hook_mode(x, idx, m, ll_experts, add, transport: str, row_fp8: int,
                          wire: dict[str, int] | None) -> None:  # fmt: skip
        """Hook mode: the send and the receive (hook) timed apart, and together."""

        def hooked() -> None:
            out = ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=True,
                                          return_recv_hook=True)  # fmt: skip
            assert out.hook is not None
            out.hook()

        t_send, t_recv = ll_timer.split(
            lambda: ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=True,
                                            return_recv_hook=True),
            lambda out: out.hook(),
        )  # fmt: skip
        # The send puts every byte on the link; the hook only copies what has landed.
        fp8 = wire["fp8"] if wire is not None else None
        add("ll dispatch FP8, hook mode: send", t_send, row_fp8, transport, wire_bytes=fp8)
        add("ll dispatch FP8, hook mode: recv (hook)", t_recv, row_fp8, transport,
            wire_bytes=0 if wire is not None else None)  # fmt: skip
        add("ll dispatch FP8, hook mode: send+recv", ll_timer(hooked), row_fp8, transport,
            wire_bytes=fp8)  # fmt: skip

    def measure_graphs(x, y, idx, weights, m, ll_experts, add, transport: str, row_fp8: int,
                       row_bf16: int, wire: dict[str, int] | None) -> None:  # fmt: skip
        """Dispatch, combine and the pair replayed from CUDA graphs (how decode runs them)."""
        w = wire or {}
        # Eager calls pay this host's launch gap between kernels; a graph of `calls` calls
        # back to back keeps the GPU busy, so time / calls is the kernels' own latency.
        # An even count of alternating-buffer dispatches (or dispatch+combine pairs) is what
        # makes back-to-back replays safe (docs/low_latency.md).
        calls = 16

        aligned: dict[str, float] = {}

        def per_call(body: Callable[[], object], name: str) -> tuple[float, float]:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    body()
            us, host_us = ll_timer(graph.replay)
            aligned[name] = ll_timer.aligned(graph.replay) / calls
            return us / calls, host_us / calls

        def pair() -> None:
            g_d = ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=True)
            ep.low_latency_combine(y, idx, weights, g_d.handle)

        g_fp8 = per_call(
            lambda: ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=True), "fp8"
        )
        g_bf16 = per_call(
            lambda: ep.low_latency_dispatch(x, idx, m, ll_experts, use_fp8=False), "bf16"
        )
        g_pair = per_call(pair, "pair")
        note = f"{transport}, CUDA graph of {calls}"
        add("ll dispatch FP8 (graph)", g_fp8, row_fp8, note, wire_bytes=w.get("fp8"))
        add("ll dispatch BF16 (graph)", g_bf16, row_bf16, note, wire_bytes=w.get("bf16"))
        add("ll combine BF16 (graph: pair - FP8 dispatch)",
            (g_pair[0] - g_fp8[0], g_pair[1] - g_fp8[1]), row_bf16, note,
            wire_bytes=w.get("combine"))  # fmt: skip
        add("ll dispatch FP8 + combine BF16 (graph)", g_pair, row_fp8 + row_bf16, note,
            wire_bytes=w.get("pair"))  # fmt: skip
        # The same graphs timed from a point where the GPUs are in step (one untimed replay
        # first): the rows above also hold the host barrier's skew between ranks / calls.
        note = f"{transport}, CUDA graph of {calls}, GPUs in step"
        a_fp8, a_bf16, a_pair = aligned["fp8"], aligned["bf16"], aligned["pair"]
        add("ll dispatch FP8 (graph, in step)", (a_fp8, g_fp8[1]), row_fp8, note,
            wire_bytes=w.get("fp8"))  # fmt: skip
        add("ll dispatch BF16 (graph, in step)", (a_bf16, g_bf16[1]), row_bf16, note,
            wire_bytes=w.get("bf16"))  # fmt: skip
        add("ll combine BF16 (graph, in step: pair - FP8 dispatch)",
            (a_pair - a_fp8, g_pair[1] - g_fp8[1]), row_bf16, note,
            wire_bytes=w.get("combine"))  # fmt: skip
        add("ll dispatch FP8 + combine BF16 (graph, in step)", (a_pair, g_pair[1]),
            row_fp8 + row_bf16, note, wire_bytes=w.get("pair"))  # fmt: skip
        # The same pair with each rank's sums returned as BF16 (half their bytes): the option
        # is read when the combine is captured, so the graph replays it after it is reset.
        with _bf16_partials():
            b_pair = per_call(pair, "pair_bf16p")
        note += "; Options.low_latency_combine_bf16_partials"
        a_pair_b = aligned["pair_bf16p"]
        add("ll combine BF16, BF16 partials (graph, in step: pair - FP8 dispatch)",
            (a_pair_b - a_fp8, b_pair[1] - g_fp8[1]), row_bf16, note,
            wire_bytes=w.get("combine_bf16p"))  # fmt: skip
        add("ll dispatch FP8 + combine BF16, BF16 partials (graph, in step)",
            (a_pair_b, b_pair[1]), row_fp8 + row_bf16, note,
            wire_bytes=w.get("pair_bf16p"))  # fmt: skip

    if args.high_throughput:
        measure_limit(args.tokens)
        measure(args.tokens, full=True)
    if args.high_throughput and args.sweep:
        t = 128
        while t <= args.sweep_max:
            measure(t, full=False)
            t *= 2
    if args.low_latency and shared_gpus:
        # NVSHMEM needs a GPU per rank and the ATen fallback runs on NCCL, which refuses two
        # ranks on one GPU.
        if rank == 0:
            print("low-latency section skipped: ranks share GPUs", flush=True)
    elif args.low_latency:
        measure_low_latency(min(args.ll_tokens, args.ll_max_tokens), full=True)
        if args.sweep:
            for t in (1, 8, 32, 64, 256):
                if t <= args.ll_max_tokens:
                    measure_low_latency(t, full=False)
    late_median, late_max, barriers = _barrier_lateness()
    if rank == 0:
        Path(result_path).write_text(json.dumps([asdict(r) for r in rows]))
        # Ranks that leave a barrier late make their peers' next agreement wait: "call" and
        # "host" then hold that wait.
        print(f"host barriers: the latest rank left {barriers} barriers a median {late_median:.1f} "
              f"µs (max {late_max:.1f}) after the agreed start", flush=True)  # fmt: skip
        # How the MoE calls' agreement step went ("shared memory" on one host; "gloo" costs tens
        # of µs per call more): part of every "call" and "host" figure above.
        print(f"MoE agreement: {ep.get_backend(group).moe_agreement_transport}", flush=True)
    from ep_backend._push_limit import close_on_every_rank

    close_on_every_rank(probe)  # unmaps the peers' buffers everywhere before anyone frees its own
    dist.barrier()
    dist.destroy_process_group()


def _print_table(rows: list[dict], header: str, on_gpu: bool) -> None:
    """Prints rows as an aligned table; "call" and "host" are GPU-only columns."""
    print(header)
    width = max([len("op")] + [len(r["op"]) for r in rows])
    cols = [("T", 6), ("time µs", 10)]
    if on_gpu:
        cols += [("call µs", 9), ("host µs", 9)]
    cols += [("remote GB/s", 12), ("logical GB/s", 13)]
    with_pct = any(r.get("limit_pct") for r in rows)
    with_sms = any(r.get("num_sms") for r in rows)
    if with_pct:
        cols += [("% limit", 8)]
    if with_sms:
        cols += [("SMs", 4)]
    line = f"{'op':{width}s} " + " ".join(f"{name:>{w}s}" for name, w in cols)
    print(line + "  note")
    for r in rows:
        cells = [f"{r['tokens']:6d}", f"{r['us']:10.1f}"]
        if on_gpu:
            call = f"{r['call_us']:9.1f}" if r.get("call_us") else f"{'-':>9s}"
            cells += [call, f"{r['host_us']:9.1f}"]
        cells += [f"{r['remote_gbps']:12.3f}", f"{r['logical_gbps']:13.3f}"]
        if with_pct:
            cells += [f"{r['limit_pct']:8.1f}" if r.get("limit_pct") else f"{'-':>8s}"]
        if with_sms:
            cells += [f"{r['num_sms']:4d}" if r.get("num_sms") else f"{'-':>4s}"]
        text = f"{r['op']:{width}s} " + " ".join(cells)
        print(text + (f"  {r['note']}" if r["note"] else ""))


def _build_summary() -> str:
    """What the installed ep_backend was built with (pip hides the build's own output)."""
    from ep_backend import _C

    if _C.built_with_cuda:
        return f"CUDA kernels for {_C.cuda_architectures}"
    return f"CPU only ({_C.cpu_build_reason or 'no reason recorded'})"


def _check_args(args: argparse.Namespace, nprocs: int, on_gpu: bool) -> str | None:
    """Why the shape or process count cannot run (None when it can), before any process starts."""
    if nprocs < 1:
        return f"--nprocs {nprocs}: need at least 1 process"
    if on_gpu and nprocs > torch.cuda.device_count() * 8:
        return f"--nprocs {nprocs}: more than 8 ranks per GPU ({torch.cuda.device_count()} GPUs)"
    for name in ("tokens", "hidden", "topk", "experts", "iters", "ll_tokens", "ll_max_tokens",
                 "ll_experts", "a2a_iters"):  # fmt: skip
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1"
    if args.num_sms < 0:
        return f"--num-sms {args.num_sms}: must be at least 1 (0: the default)"
    if args.warmup < 0:
        return f"--warmup {args.warmup}: must be at least 0"
    if args.experts % nprocs:
        return f"--experts {args.experts} is not divisible by the {nprocs} processes"
    if args.topk > args.experts:
        return f"--topk {args.topk} is larger than --experts {args.experts}"
    if args.hidden * 2 % 16:
        return f"--hidden {args.hidden}: a BF16 row must be a multiple of 16 bytes (H % 8 == 0)"
    if args.hidden % 128:
        return f"--hidden {args.hidden}: the FP8 rows need H % 128 == 0"
    if args.low_latency:
        if args.ll_experts % nprocs:
            return f"--ll-experts {args.ll_experts} is not divisible by the {nprocs} processes"
        if args.topk > args.ll_experts:
            return f"--topk {args.topk} is larger than --ll-experts {args.ll_experts}"
    return None


@contextmanager
def _bf16_partials() -> Iterator[None]:
    """``Options.low_latency_combine_bf16_partials`` set for the calls (or captures) inside."""
    import ep_backend as ep

    options = ep.get_backend().options
    options.low_latency_combine_bf16_partials = True
    try:
        yield
    finally:
        options.low_latency_combine_bf16_partials = False


def _plot(rows: list[dict], path: Path) -> bool:
    from ep_backend._pyplot import pyplot

    plt = pyplot()
    if plt is None:
        return False
    for op, label in (
        ("ep dispatch+combine BF16", "ep"),
        ("baseline a2a pipeline (both ways)", "all_to_all pipeline"),
    ):
        pts = sorted((r["tokens"], r["us"]) for r in rows if r["op"] == op and r["us"] > 0)
        plt.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    plt.xscale("log", base=2)
    plt.yscale("log")
    plt.xlabel("tokens per rank")
    plt.ylabel("dispatch + combine time (µs)")
    plt.legend()
    plt.grid(True, which="both", alpha=0.3)
    plt.savefig(path, dpi=120, bbox_inches="tight")
    return True


def _all_to_all_section(gpus: int, iters: int, out: Path, probe_lib: str | None) -> int:
    """Runs the all-to-all section at each of its rank counts, after the other sections' processes
    have ended; prints its tables and writes its plot and JSON into ``out``. 1 if a run failed.

    ``probe_lib``: the push-limit probe the HT section compiled ("": it could not), None when that
    section did not try (the section then compiles it into ``out``).
    """
    from ep_backend import _bench_all_to_all as a2a

    counts = a2a.rank_counts(gpus)
    if not counts:
        why = "running on CPU" if gpus == 0 else f"{gpus} GPU"
        print(f"\nall-to-all section skipped: needs at least 2 GPUs ({why})", flush=True)
        return 0
    print(f"\n== all-to-all at {' and '.join(map(str, counts))} ranks (per-peer sizes; "
          f"{iters} calls per size; x NCCL, % limit: ep host splits vs NCCL and the push "
          "limit) ==", flush=True)  # fmt: skip
    if probe_lib is None:
        probe_lib = a2a.compile_push_limit(out / ".push_limit")
    by_world: dict[int, dict] = {}
    status = 0
    for world in counts:
        try:
            results = a2a.run(world, iters, _free_port(), probe_lib)
        except Exception as e:  # noqa: BLE001 - the other sections' results still stand
            print(f"all-to-all at {world} ranks failed: {type(e).__name__}: {e}", flush=True)
            status = 1
            continue
        by_world[world] = results
        print("\n".join(a2a.format_table(results, world)), flush=True)
    if not by_world:
        return status
    data = {str(w): {str(k): v for k, v in r.items()} for w, r in by_world.items()}
    (out / "bench_all_to_all.json").write_text(json.dumps(data, indent=1))
    png = out / "bench_all_to_all.png"
    if a2a.plot(by_world, png):
        print(f"plot: {png}")
    else:
        print("all-to-all plot: not written (no matplotlib)")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_backend.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU processes even if GPUs exist"
    )
    parser.add_argument(
        "--nprocs", type=int, default=0, help="processes (default: GPUs, or 2 on CPU)"
    )
    parser.add_argument(
        "--tokens", type=int, default=0, help="T per rank (default 4096 GPU / 256 CPU)"
    )
    parser.add_argument("--hidden", type=int, default=0, help="H (default 7168 GPU / 1024 CPU)")
    parser.add_argument("--topk", type=int, default=8, help="K: experts per token (default 8)")
    parser.add_argument("--experts", type=int, default=0, help="E (default 256 GPU / 16 CPU)")
    parser.add_argument("--iters", type=int, default=0, help="timed calls (default 30 GPU / 5 CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--sweep", action="store_true", help="also sweep T from 128 (GPU default)")
    parser.add_argument("--no-sweep", action="store_true", help="no sweep over T, also on GPUs")
    parser.add_argument("--sweep-max", type=int, default=16384,
                        help="largest T of the sweep (default 16384 GPU / 1024 CPU)")  # fmt: skip
    parser.add_argument("--no-high-throughput", dest="high_throughput", action="store_false",
                        help="skip the standard-shape section and its sweep")  # fmt: skip
    parser.add_argument("--no-low-latency", dest="low_latency", action="store_false",
                        help="skip the low-latency (decode) section")  # fmt: skip
    parser.add_argument("--ll-tokens", type=int, default=128, help="low-latency T (default 128)")
    parser.add_argument("--ll-max-tokens", type=int, default=256,
                        help="num_max_dispatch_tokens_per_rank M of the low-latency section")  # fmt: skip
    parser.add_argument("--ll-experts", type=int, default=16, help="low-latency E (default 16)")
    parser.add_argument("--num-sms", type=int, default=0,
                        help="Options.num_sms of the HT ops (default: Options' own, 24)")  # fmt: skip
    parser.add_argument("--sm-sweep", action="store_true",
                        help="also time HT dispatch and combine (BF16) at num_sms 4..all SMs, "
                             "and the push limit at each (GPUs only)")  # fmt: skip
    parser.add_argument("--no-all-to-all", dest="all_to_all", action="store_false",
                        help="skip the all-to-all section (ep vs NCCL all_to_all_single at 2 "
                             "ranks and at every GPU; needs >= 2 GPUs)")  # fmt: skip
    parser.add_argument("--a2a-iters", type=int, default=20,
                        help="timed calls per size of the all-to-all section (default 20; a "
                             "tenth of it, at least 3, from 64 MiB per peer)")  # fmt: skip
    parser.add_argument("--out", type=str, default="bench_out",
                        help="folder for bench.json and the plots (default ./bench_out)")  # fmt: skip
    args = parser.parse_args(argv)
    os.environ.update(_ENV)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 0
    on_gpu = gpus > 0
    args.cpu = not on_gpu
    nprocs = args.nprocs or (gpus if on_gpu else 2)
    args.tokens = args.tokens or (4096 if on_gpu else 256)
    args.hidden = args.hidden or (7168 if on_gpu else 1024)
    args.experts = args.experts or (256 if on_gpu else 16)
    args.iters = args.iters or (30 if on_gpu else 5)
    args.sweep = (args.sweep or on_gpu) and not args.no_sweep
    if not on_gpu:
        args.sweep_max = min(args.sweep_max, 1024)
    problem = _check_args(args, nprocs, on_gpu)
    if problem is not None:
        print(f"ep bench: error: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "bench.json"
    device_name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    if on_gpu and nprocs > gpus:
        device_name += f" (shared: {nprocs} ranks on {gpus} GPU(s); not an NVLink figure)"
    print(f"ep bench: {nprocs} x {device_name}, T={args.tokens} H={args.hidden} top-{args.topk} "
          f"of E={args.experts}, BF16; torch {torch.__version__}", flush=True)  # fmt: skip
    print(f"ep build: {_build_summary()}", flush=True)
    args.probe_lib, args.probe_reason = "", "needs GPUs (one per rank)"
    # The HT rows read against the limit at the ops' SM budget, the LL rows against all SMs.
    probe_tried = on_gpu and (args.high_throughput or args.low_latency) and 2 <= nprocs <= gpus
    if probe_tried:
        from ep_backend._push_limit import compile_probe, device_arch

        lib, args.probe_reason = compile_probe(
            out / ".push_limit", device_arch(torch.device("cuda", 0))
        )
        args.probe_lib = str(lib) if lib is not None else ""
        if lib is None:
            print(f"push limit: not measured: {args.probe_reason}", flush=True)
    if args.sm_sweep and not on_gpu:
        print("--sm-sweep: needs GPUs (one per rank); not run on CPU", flush=True)
    mp.start_processes(_worker, args=(nprocs, _free_port(), args, str(result_path)), nprocs=nprocs,
                       start_method="spawn")  # fmt: skip
    rows = json.loads(result_path.read_text())
    ll_rows = [r for r in rows if r["op"].startswith(("ll ", "baseline all_to_all_single"))]
    sm_rows = [r for r in rows if r["op"].startswith("sm sweep")]
    rows_ht = [r for r in rows if r not in ll_rows and r not in sm_rows]
    main_rows = [r for r in rows_ht if r["tokens"] == args.tokens]
    if main_rows:
        _print_table(main_rows, f"\n== standard shape (T={args.tokens}) ==", on_gpu)
    if ll_rows:
        gbps = ("remote GB/s = wire bytes of the busiest GPU / time, % limit: of the push limit "
                "with all SMs; logical GB/s = rows sent x row bytes / time" if on_gpu
                else "GB/s = rows sent x row bytes / time")  # fmt: skip
        _print_table(ll_rows, f"\n== low latency (M={args.ll_max_tokens}, top-{args.topk} of "
                              f"E={args.ll_experts}; {gbps}) ==", on_gpu)  # fmt: skip
    sweep_rows = [r for r in rows_ht if "dispatch+combine" in r["op"] or "baseline" in r["op"]]
    if args.sweep and sweep_rows:
        _print_table(sweep_rows, "\n== sweep over T: dispatch+combine vs baseline ==", on_gpu)
        png = out / "bench_sweep.png"
        if _plot(sweep_rows, png):
            print(f"plot: {png}")
    if sm_rows:
        _print_table(sm_rows, f"\n== SM budget sweep (T={args.tokens}; % limit: of the push "
                              "limit at the same num_sms) ==", on_gpu)  # fmt: skip
        for op in ("sm sweep: dispatch BF16", "sm sweep: combine BF16"):
            found = smallest_sms_reaching(sm_rows, op)
            if found is not None:
                print(f"{op.removeprefix('sm sweep: ')}: {found[0]} SMs reach 95% of its best "
                      f"({found[2]:.1f} µs at {found[1]} SMs)")  # fmt: skip
    if on_gpu and nprocs <= gpus:  # issue 43's targets, read off this run's rows
        from ep_backend._bench_targets import format_targets, plot_targets, read_targets

        results = read_targets(rows, nprocs)
        if results:
            print(f"\n== issue 43 targets at EP{nprocs} (this run) ==")
            print("\n".join(format_targets(results)))
            png = out / "bench_targets.png"
            if plot_targets(results, png, f"issue 43 targets, EP{nprocs}, {device_name}"):
                print(f"plot: {png}")
    status = 0
    if args.all_to_all:
        status = _all_to_all_section(gpus, args.a2a_iters, out,
                                     args.probe_lib if probe_tried else None)  # fmt: skip
    print(f"results: {result_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
