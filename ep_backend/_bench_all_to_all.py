"""The bench's all-to-all section: ep (host splits), ep (device splits), NCCL all_to_all_single,
torch symm_mem all_to_all_vdev where it runs, and the all-peer push limit, in one run.

``python -m ep_backend.bench`` runs it after its other sections at 2 ranks and at every GPU (when
there are more than 2), prints the tables with the issue-42 targets and writes
``bench_all_to_all.png``; ``benchmarks/all_to_all.py`` is a command line for one rank count.

One process per GPU. Per-peer sizes 4 KiB .. 256 MiB; every row moves the same bytes (equal
splits, bf16 rows of 4 KiB where the size allows). Time: CUDA-event time per call of ``iters``
back-to-back calls (a quarter of them, at least 5, from 64 MiB per peer) after warm-up and one
untimed call that puts the ranks in step, the median of 5 such loops, the slowest rank's. GB/s:
per-GPU egress to peers, (R - 1) x per-peer bytes / time (the convention of design.md section 6).
The "(host µs/call)" columns are the host time to issue one call on an idle GPU: a row whose
back-to-back GPU time is no larger is bound by the host (for NCCL: torch's own Python and
dispatcher layers included). The push limit row: every GPU pushes the same bytes to all its peers
at once with all SMs, the bench's probe (``ep_backend/_push_limit.py``: one kernel, 4 KiB rows
round-robin over the peers, CUDA IPC buffers); issue 42's large-message target is a ratio to it.

Results of one rank count are a dict: ``results[size][row] -> µs (float) or why not (str)`` for
every size of :data:`SIZES`, and ``results["transport"]``: ep's all-to-all transport.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_backend._pyplot import pyplot
from ep_backend.bench import gpu_us_per_call, host_us_per_call

# Bytes each rank sends to each peer.
SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20, 256 << 20]

HOST = " (host µs/call)"  # a column of host time, not of a transfer
GRAPH = ", CUDA graph"  # the same calls replayed from a graph: no host time per call

# Row names (the targets read these three).
EP_HOST = "ep host splits"
NCCL = "NCCL all_to_all_single"
LIMIT = "push limit (all SMs)"

# Issue 42's targets for ``ep host splits``.
SMALL_MAX = 1 << 20  # ">= 2x NCCL" at sizes up to this
LARGE_MIN = 64 << 20  # ">= 90% of the push limit" at sizes from this

Results = dict[Any, Any]  # {size: {row: float | str}, "transport": str}

_CELL = 28  # the narrowest table column


REPEATS = 5  # timed loops per row and size: their median (one host hiccup moves one loop)


def _time_us(fn: Callable[[], object], iters: int) -> float:
    """µs per call: the median of :data:`REPEATS` loops of ``iters`` back-to-back calls, after
    three warm-up calls, each loop started by an untimed call that puts the ranks in step (see
    ``gpu_us_per_call``'s ``in_step``; every row alike, NCCL's and the push limit's too)."""
    loops = [
        gpu_us_per_call(fn, iters, warmup=3 if i == 0 else 0, in_step=True) for i in range(REPEATS)
    ]
    return sorted(loops)[REPEATS // 2]


def _graph_us(fn: Callable[[], object], iters: int) -> float | str:
    """µs per call of ``iters`` calls captured in one CUDA graph, median of :data:`REPEATS`
    replays: the kernels' time without the host's (equal splits are capturable), or why not."""
    try:
        fn()  # warm-up outside the capture (sets up communicators and buffers)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except RuntimeError as e:
        torch.cuda.synchronize()
        return f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    graph.replay()  # warm replay
    loops = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        loops.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(loops)[REPEATS // 2]


def _slowest(us: float) -> float:
    t = torch.tensor([us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rows(
    rank: int, world: int, per_peer: int, iters: int, nccl: dist.ProcessGroup, probe_lib: str
) -> dict[str, float | str]:
    """Every row at one per-peer size, this rank's times."""
    import ep_backend

    elems = per_peer // 2
    width = min(2048, elems)
    rows = elems // width
    x = torch.randn(world * rows, width, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    out: dict[str, float | str] = {}
    out[EP_HOST] = _time_us(lambda: dist.all_to_all_single(y, x), iters)
    out[EP_HOST + HOST] = host_us_per_call(lambda: dist.all_to_all_single(y, x), iters)
    splits = torch.full((world,), rows, dtype=torch.int64, device="cuda")
    out["ep device splits"] = _time_us(lambda: ep_backend.all_to_all_v(x, splits, y), iters)
    out["ep device splits" + HOST] = host_us_per_call(
        lambda: ep_backend.all_to_all_v(x, splits, y), iters
    )
    out[NCCL] = _time_us(lambda: dist.all_to_all_single(y, x, group=nccl), iters)
    out[NCCL + HOST] = host_us_per_call(lambda: dist.all_to_all_single(y, x, group=nccl), iters)
    out[EP_HOST + GRAPH] = _graph_us(lambda: dist.all_to_all_single(y, x), iters)
    out[NCCL + GRAPH] = _graph_us(lambda: dist.all_to_all_single(y, x, group=nccl), iters)
    out["symm_mem all_to_all_vdev"] = _symm_mem_row(rank, world, x, rows, iters, nccl)
    out[LIMIT] = _push_limit(rank, world, per_peer, iters, probe_lib)
    return out


def _symm_mem_row(
    rank: int, world: int, x: torch.Tensor, rows: int, iters: int, nccl: dist.ProcessGroup
) -> float | str:
    """torch's NVSHMEM all_to_all_vdev of the same bytes, or why it cannot run."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        # The rank's own device, by index: torch's NVSHMEM team manager keeps the first device
        # it is given and refuses any other, and "cuda" alone is not resolved to the index.
        device = x.device
        inp = symm_mem.empty(x.numel(), dtype=x.dtype, device=device)
        outb = symm_mem.empty(x.numel() * 2, dtype=x.dtype, device=device)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=device)
        out_so = symm_mem.empty((2, world), dtype=torch.int64, device=device)
        symm_mem.rendezvous(inp, nccl.group_name)
        symm_mem.rendezvous(outb, nccl.group_name)
        symm_mem.rendezvous(in_splits, nccl.group_name)
        symm_mem.rendezvous(out_so, nccl.group_name)
        inp.copy_(x.view(-1))
        in_splits.fill_(x.numel() // world)
        op = torch.ops.symm_mem.all_to_all_vdev
        return _time_us(lambda: op(inp, outb, in_splits, out_so, nccl.group_name), iters)
    except Exception as e:  # noqa: BLE001 - the row says why it cannot run
        return f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def _push_limit(rank: int, world: int, per_peer: int, iters: int, probe_lib: str) -> float | str:
    """µs of one launch of the bench's push-limit probe (ep_backend/_push_limit.py) with all SMs:
    every GPU pushes ``per_peer`` bytes to each peer at once, 4 KiB rows (the other rows' size)."""
    if not probe_lib:
        return "n/a: the push-limit probe did not compile (nvcc)"
    from ep_backend._push_limit import close_on_every_rank, open_on_every_rank

    device = torch.device("cuda", torch.cuda.current_device())
    store = dist.distributed_c10d._get_default_store()
    probe, why = open_on_every_rank(Path(probe_lib), store, f"a2a_bench/push_limit/{per_peer}",
                                    rank, world, device, min(4096, per_peer),
                                    per_peer * (world - 1), device)  # fmt: skip
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    result: float | str = (
        _time_us(lambda: probe.launch(sms), iters)  # type: ignore[union-attr]
        if probe is not None
        else f"n/a: {why}"[:120]
    )
    close_on_every_rank(probe)
    return result


def _worker(rank: int, world: int, iters: int, port: int, probe_lib: str, results: Any) -> None:
    """One rank: every size's rows, the slowest rank's; rank 0 fills ``results`` (a dict proxy)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    import ep_backend  # noqa: F401 - registers "ep"

    dist.init_process_group("ep", rank=rank, world_size=world)
    nccl = dist.new_group(backend="nccl")
    table: Results = {}
    for size in SIZES:
        n = iters if size < (64 << 20) else max(5, iters // 4)
        row = _rows(rank, world, size, n, nccl, probe_lib)
        table[size] = {k: (_slowest(v) if isinstance(v, float) else v) for k, v in row.items()}
    if rank == 0:
        table["transport"] = ep_backend.get_backend().all_to_all_transport
        results.update(table)
    dist.barrier()
    dist.destroy_process_group()


def compile_push_limit(cache_dir: Path | None = None) -> str:
    """Path of the push-limit probe library for GPU 0 ("" when it cannot be built: says why)."""
    from ep_backend._push_limit import compile_probe, device_arch

    cache = cache_dir or Path(tempfile.gettempdir()) / "ep_a2a_push_limit"
    lib, why = compile_probe(cache, device_arch(torch.device("cuda", 0)))
    if lib is None:
        print(f"push limit: not measured: {why}", flush=True)
    return str(lib or "")


def run(ranks: int, iters: int, port: int, probe_lib: str) -> Results:
    """Runs the section on ``ranks`` GPUs (one process each, rendezvous on ``port``)."""
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(ranks, iters, port, probe_lib, shared), nprocs=ranks)
        return dict(shared)


def rank_counts(gpus: int) -> list[int]:
    """The rank counts the bench runs the section at: 2, and every GPU when there are more."""
    if gpus < 2:
        return []
    return [2] if gpus == 2 else [2, gpus]


def size_label(size: int) -> str:
    """``4 KiB``, ``1 MiB``, ``256 MiB``."""
    if size >= (1 << 20) and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    return f"{size >> 10} KiB"


def ratios(results: Mapping[Any, Any]) -> dict[int, tuple[float | None, float | None]]:
    """Per size: (``ep host splits`` x NCCL, ``ep host splits`` as % of the push limit).

    Both rows move the same bytes, so the ratios are ratios of times: NCCL µs / ep µs (> 1: ep is
    faster) and 100 x limit µs / ep µs. None where a row did not run at that size.
    """
    out: dict[int, tuple[float | None, float | None]] = {}
    for size in SIZES:
        row = results.get(size, {})
        ep, nccl, limit = row.get(EP_HOST), row.get(NCCL), row.get(LIMIT)
        ok = isinstance(ep, float) and ep > 0
        x = nccl / ep if ok and isinstance(nccl, float) else None
        pct = 100.0 * limit / ep if ok and isinstance(limit, float) else None
        out[size] = (x, pct)
    return out


def target_summary(results: Mapping[Any, Any]) -> str:
    """One line: are issue 42's targets met, and the worst size of each (printed, not asserted).

    ``>= NCCL at every size``, ``>= 2x NCCL at <= 1 MiB`` and ``>= 90% of the push limit at
    >= 64 MiB``, all of ``ep host splits``; "n/a" where a row it needs did not run.
    """
    r = ratios(results)

    def verdict(sizes: list[int], pick: int, goal: float, unit: str, row: str) -> str:
        vals = [(r[s][pick], s) for s in sizes]
        if any(v is None for v, _ in vals):
            return f"n/a ({row} not measured at every size)"
        worst, size = min((v, s) for v, s in vals if v is not None)
        met = "yes" if worst >= goal else "no"
        shown = f"{worst:.2f}x" if unit == "x" else f"{worst:.1f}%"
        return f"{met} (worst {size_label(size)}: {shown})"

    small = [s for s in SIZES if s <= SMALL_MAX]
    large = [s for s in SIZES if s >= LARGE_MIN]
    return (
        "targets (issue 42): "
        f">= NCCL at every size: {verdict(SIZES, 0, 1.0, 'x', NCCL)}; "
        f">= 2x NCCL at <= {size_label(SMALL_MAX)}: {verdict(small, 0, 2.0, 'x', NCCL)}; "
        f">= 90% of the push limit at >= {size_label(LARGE_MIN)}: "
        f"{verdict(large, 1, 90.0, '%', 'the push limit')}"
    )


def format_table(results: Mapping[Any, Any], world: int) -> list[str]:
    """The section's lines for one rank count: header, a line per size (each row's µs and GB/s or
    host µs; then ``ep host splits`` x NCCL and % of the push limit), the rows that did not run
    and why, and the targets line."""
    lines = [f"all-to-all, {world} ranks, ep transport: {results.get('transport')}"]
    names = list(results[SIZES[0]])
    widths = [max(_CELL, len(n)) for n in names]
    head = " ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
    lines.append(f"{'per peer':>11} {head} {'x NCCL':>7} {'% limit':>7}")
    r = ratios(results)
    for size in SIZES:
        cells = []
        for n, w in zip(names, widths, strict=True):
            v = results[size].get(n, "n/a")
            if isinstance(v, float) and n.endswith(HOST):
                cell = f"{v:10.1f} us host"
            elif isinstance(v, float):
                gbs = (world - 1) * size / v / 1e3
                cell = f"{v:10.1f} us {gbs:7.1f} GB/s"
            else:
                cell = v[:_CELL]
            cells.append(f"{cell:>{w}}")
        x, pct = r[size]
        tail = f"{x:6.2f}x" if x is not None else f"{'-':>7}"
        tail += f" {pct:6.1f}%" if pct is not None else f" {'-':>7}"
        lines.append(f"{size >> 10:>7} KiB " + " ".join(cells) + " " + tail)
    for n in names:
        for size in SIZES:
            v = results[size].get(n, "n/a")
            if not isinstance(v, float):
                lines.append(f"  {n}: {v}")
                break
    lines.append(target_summary(results))
    return lines


def plot(by_world: Mapping[int, Mapping[Any, Any]], path: Path | str) -> bool:
    """Time and GB/s vs bytes per peer, a curve per row, a pair of panels per rank count.

    False (nothing written) when matplotlib is missing.
    """
    plt = pyplot()
    if plt is None:
        return False
    worlds = sorted(by_world)
    fig, axes = plt.subplots(len(worlds), 2, figsize=(12, 4.5 * len(worlds)), squeeze=False)
    for (a, b), world in zip(axes, worlds, strict=True):
        results = by_world[world]
        for n in results[SIZES[0]]:
            if n.endswith(HOST):
                continue
            pts = [(s, results[s][n]) for s in SIZES if isinstance(results[s].get(n), float)]
            if not pts:
                continue
            xs = [s / 1024 for s, _ in pts]
            a.plot(xs, [v for _, v in pts], marker="o", label=n)
            b.plot(xs, [(world - 1) * s / v / 1e3 for s, v in pts], marker="o", label=n)
        for ax, label in ((a, "time (us)"), (b, "egress GB/s per GPU")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes per peer (KiB)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"all-to-all, {world} ranks")
        a.set_yscale("log")
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
