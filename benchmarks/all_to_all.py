"""All-to-all bench: ep (host splits), ep (device splits), NCCL all_to_all_single,
torch symm_mem all_to_all_vdev where it runs, and the all-peer push limit, in one run.

    python benchmarks/all_to_all.py [--ranks R] [--iters N] [--png out.png]

One process per GPU (R defaults to every visible GPU). Per-peer sizes 4 KiB .. 256 MiB; every row
moves the same bytes (equal splits, bf16 rows of 4 KiB where the size allows). Time: median over
ranks' CUDA-event times of `iters` back-to-back calls after warm-up, the slowest rank's. GB/s:
per-GPU egress to peers, (R - 1) x per-peer bytes / time (the convention of design.md section 6).
The push limit row: every GPU pushes the same bytes to all its peers at once with all SMs, the
bench's probe (``ep_backend/_push_limit.py``: one kernel, 4 KiB rows round-robin over the peers,
CUDA IPC buffers); issue 42's large-message target is a ratio to it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20, 256 << 20]


def _time_us(fn, iters: int) -> float:
    """µs per call of ``iters`` back-to-back calls after three warm-up calls."""
    from ep_backend.bench import gpu_us_per_call  # after the worker's set_device

    return gpu_us_per_call(fn, iters, warmup=3)


def _host_us(fn, iters: int) -> float:
    """Host µs to issue one call, median of ``iters`` calls each made on an idle GPU: when the
    GPU time of back-to-back calls is no larger, the row is bound by the host, not the kernel."""
    import time

    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


HOST = " (host µs/call)"  # a column of host time, not of a transfer


def _slowest(us: float) -> float:
    t = torch.tensor([us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rows(
    rank: int, world: int, per_peer: int, iters: int, nccl: dist.ProcessGroup, probe_lib: str
) -> dict[str, float | str]:
    import ep_backend

    elems = per_peer // 2
    width = min(2048, elems)
    rows = elems // width
    x = torch.randn(world * rows, width, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    out: dict[str, float | str] = {}
    out["ep host splits"] = _time_us(lambda: dist.all_to_all_single(y, x), iters)
    out["ep host splits" + HOST] = _host_us(lambda: dist.all_to_all_single(y, x), iters)
    splits = torch.full((world,), rows, dtype=torch.int64, device="cuda")
    out["ep device splits"] = _time_us(lambda: ep_backend.all_to_all_v(x, splits, y), iters)
    out["ep device splits" + HOST] = _host_us(lambda: ep_backend.all_to_all_v(x, splits, y), iters)
    out["NCCL all_to_all_single"] = _time_us(
        lambda: dist.all_to_all_single(y, x, group=nccl), iters
    )
    out["symm_mem all_to_all_vdev"] = _symm_mem_row(rank, world, x, rows, iters, nccl)
    out["push limit (all SMs)"] = _push_limit(rank, world, per_peer, iters, probe_lib)
    return out


def _symm_mem_row(rank, world, x, rows, iters, nccl) -> float | str:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        inp = symm_mem.empty(x.numel(), dtype=x.dtype, device="cuda")
        outb = symm_mem.empty(x.numel() * 2, dtype=x.dtype, device="cuda")
        in_splits = symm_mem.empty(world, dtype=torch.int64, device="cuda")
        out_so = symm_mem.empty((2, world), dtype=torch.int64, device="cuda")
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
    from ep_backend._push_limit import PushLimitProbe

    device = torch.device("cuda", torch.cuda.current_device())
    row_bytes = min(4096, per_peer)
    store = dist.distributed_c10d._get_default_store()
    probe = None
    why = ""
    try:
        probe = PushLimitProbe(Path(probe_lib), store, f"a2a_bench/push_limit/{per_peer}", rank,
                               world, device, row_bytes, per_peer * (world - 1))  # fmt: skip
        why = probe.setup_error
    except (OSError, RuntimeError, ValueError) as e:
        why = str(e)
    ok = torch.tensor([0 if why else 1], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank measures it or none does
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    result: float | str = (
        _time_us(lambda: probe.launch(sms), iters)  # type: ignore[union-attr]
        if int(ok.item()) == 1
        else f"n/a: {why or 'the probe failed on another rank'}"[:120]
    )
    if probe is not None:
        probe.close()
        dist.barrier()  # no peer maps this rank's buffer any more
        probe.free()
    return result


def _worker(rank: int, world: int, iters: int, port: int, probe_lib: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    import ep_backend  # noqa: F401 - registers "ep"

    dist.init_process_group("ep", rank=rank, world_size=world)
    nccl = dist.new_group(backend="nccl")
    table = {}
    for size in SIZES:
        n = iters if size < (64 << 20) else max(3, iters // 10)
        row = _rows(rank, world, size, n, nccl, probe_lib)
        table[size] = {k: (_slowest(v) if isinstance(v, float) else v) for k, v in row.items()}
    if rank == 0:
        table["transport"] = ep_backend.get_backend().all_to_all_transport
        results.update(table)
    dist.barrier()
    dist.destroy_process_group()


def _print(results: dict, world: int) -> None:
    print(f"all-to-all, {world} ranks, ep transport: {results.get('transport')}")
    names = [k for k in results[SIZES[0]]]
    print(f"{'per peer':>10} " + " ".join(f"{n:>28}" for n in names))
    for size in SIZES:
        cells = []
        for n in names:
            v = results[size][n]
            if isinstance(v, float) and n.endswith(HOST):
                cells.append(f"{v:10.1f} us host")
            elif isinstance(v, float):
                gbs = (world - 1) * size / v / 1e3
                cells.append(f"{v:10.1f} us {gbs:7.1f} GB/s")
            else:
                cells.append(f"{v[:28]:>28}")
        print(f"{size >> 10:>7} KiB " + " ".join(f"{c:>28}" for c in cells))
    for n in names:
        for size in SIZES:
            v = results[size][n]
            if not isinstance(v, float):
                print(f"  {n}: {v}")
                break


def _plot(results: dict, world: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n in results[SIZES[0]]:
        if n.endswith(HOST):
            continue
        pts = [(s, results[s][n]) for s in SIZES if isinstance(results[s][n], float)]
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
    a.set_yscale("log")
    b.legend(fontsize=8)
    fig.suptitle(f"all-to-all, {world} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--png", default="")
    args = parser.parse_args()
    if args.ranks < 2:
        raise SystemExit("needs at least 2 GPUs")
    from ep_backend._push_limit import compile_probe, device_arch

    lib, why = compile_probe(Path(tempfile.gettempdir()) / "ep_a2a_push_limit",
                             device_arch(torch.device("cuda", 0)))  # fmt: skip
    if lib is None:
        print(f"push limit: not measured: {why}")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.ranks, args.iters, args.port, str(lib or ""), results),
                 nprocs=args.ranks)  # fmt: skip
        results = dict(results)
    _print(results, args.ranks)
    if args.png:
        _plot(results, args.ranks, args.png)


if __name__ == "__main__":
    main()
