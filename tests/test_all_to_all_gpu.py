"""all-to-all on CUDA tensors through "ep" (2+ GPUs, one rank per GPU): ep's NVLink kernel
against NCCL bitwise (host splits: every dtype, random splits with zeros, non-contiguous tensors,
the list form, big multi-chunk messages, unaligned byte counts), async_op stream semantics, CUDA
graph capture, and the device-split API (1-D, 2-D, overflow, graph replay with new splits)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist_utils import gpu_world_size, run_distributed

import ep_backend
from ep_backend import reference

pytestmark = pytest.mark.gpu(min_gpus=2)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bitwise comparison, NaN payloads included)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(torch.uint8)


def _random_rows(n: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (n, width * 16), dtype=torch.uint8, generator=gen, device="cuda")
    if dtype == torch.bool:
        return raw[:, :width] % 2 == 1
    elem = torch.empty((), dtype=dtype).element_size()
    return raw[:, : width * elem].contiguous().view(dtype).view(n, width)


def _splits_matrix(world: int, seed: int, most: int) -> list[list[int]]:
    """[src][dst] rows, the same on every rank, with zeros."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, most + 1, (world, world), generator=g)
    m[torch.randint(0, world, (1,), generator=g), torch.randint(0, world, (1,), generator=g)] = 0
    return m.tolist()


def _ep_vs_nccl(rank: int, world: int) -> dict:
    nccl = dist.new_group(backend="nccl")
    gen = torch.Generator(device="cuda").manual_seed(rank)
    out: dict = {}
    for i, dtype in enumerate(DTYPES):
        m = _splits_matrix(world, i, 9)
        send = m[rank]
        recv = [m[s][rank] for s in range(world)]
        width = 1 + i % 5  # rows of 1..5 elements: unaligned byte counts for the small dtypes
        x = _random_rows(sum(send), width, dtype, gen)
        got = torch.empty((sum(recv), width), dtype=dtype, device="cuda")
        want = torch.empty_like(got)
        dist.all_to_all_single(got, x, recv, send)
        nccl_x = x.to(torch.uint8) if dtype == torch.bool else x
        nccl_out = want.to(torch.uint8) if dtype == torch.bool else want
        if dtype == torch.complex64:
            nccl_x, nccl_out = torch.view_as_real(x), torch.view_as_real(want)
        dist.all_to_all_single(nccl_out, nccl_x, recv, send, group=nccl)
        if dtype == torch.bool:
            want = nccl_out.bool()
        out[f"host_splits_{dtype}"] = torch.equal(_bits(got), _bits(want))
    # equal splits, no split sizes
    x = _random_rows(world * 64, 8, torch.bfloat16, gen)
    got, want = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(got, x)
    dist.all_to_all_single(want, x, group=nccl)
    out["equal_splits"] = torch.equal(_bits(got), _bits(want))
    # big messages: many chunks per lane (each lane's ring of 4 slots of up to 512 KiB wraps:
    # more than 96 MiB per peer at 2 ranks, 32 MiB at 4), odd tails
    m = _splits_matrix(world, 77, 1)
    per = [[(v + 4) * (25 << 20) + 17 * v for v in row] for row in m]  # ~100-125 MiB per peer
    send, recv = per[rank], [per[s][rank] for s in range(world)]
    x = _random_rows(sum(send), 1, torch.uint8, gen).view(-1)
    got = torch.empty(sum(recv), dtype=torch.uint8, device="cuda")
    want = torch.empty_like(got)
    dist.all_to_all_single(got, x, recv, send)
    dist.all_to_all_single(want, x, recv, send, group=nccl)
    out["big"] = torch.equal(got, want)
    # non-contiguous input and output (copied in and out)
    m = _splits_matrix(world, 5, 6)
    send, recv = m[rank], [m[s][rank] for s in range(world)]
    base = _random_rows(4, sum(send), torch.float32, gen)
    x = base.t()  # [sum(send), 4], not contiguous
    out_base = torch.zeros((4, sum(recv)), device="cuda")
    got = out_base.t()
    dist.all_to_all_single(got, x, recv, send)
    want = torch.empty((sum(recv), 4), device="cuda")
    dist.all_to_all_single(want, x.contiguous(), recv, send, group=nccl)
    out["non_contiguous"] = torch.equal(_bits(got), _bits(want))
    # the list form
    outs = [torch.empty((n, 4), device="cuda") for n in recv]
    dist.all_to_all(outs, list(torch.split(x.contiguous(), send)))
    out["list_form"] = torch.equal(_bits(torch.cat(outs)), _bits(want))
    # many calls in a row, sizes changing every call (the rings' credits and sequence words);
    # every fourth call moves up to 25 MiB a pair, so that calls whose pairs go by flagged lines,
    # by one ring chunk a lane and by several follow each other
    ok = True
    for it in range(40):
        most = 800_000 if it % 4 == 1 else (3000 if it % 3 else 0)
        m = _splits_matrix(world, 1000 + it, most)
        send, recv = m[rank], [m[s][rank] for s in range(world)]
        x = _random_rows(sum(send), 8, torch.int32, gen)
        got = torch.empty((sum(recv), 8), dtype=torch.int32, device="cuda")
        want = torch.empty_like(got)
        dist.all_to_all_single(got, x, recv, send)
        dist.all_to_all_single(want, x, recv, send, group=nccl)
        ok = ok and torch.equal(got, want)
    out["sequence"] = ok
    torch.cuda.synchronize()
    out["transport"] = ep_backend.get_backend().all_to_all_transport
    return out


def test_all_to_all_single_bitwise_vs_nccl() -> None:
    for out in run_distributed(_ep_vs_nccl, gpu_world_size(), backend="ep", timeout=300):
        assert out.pop("transport") == "nvlink", out
        assert all(out.values()), out


def _split_mismatch(rank: int, world: int) -> dict:
    """Rank 0 expects one more row from rank 1 than rank 1 sends it: nothing from rank 1 is
    written on rank 0, no rank hangs, rank 0's next call raises naming both, and the call after
    that is exact everywhere."""
    rows = 1 << 12  # per peer: several chunks per pair
    x = (torch.arange(world * rows, dtype=torch.float32, device="cuda") + rank * 1e7).view(-1, 1)
    want = torch.cat([torch.arange(rank * rows, (rank + 1) * rows, device="cuda") + s * 1e7
                      for s in range(world)]).view(-1, 1)  # fmt: skip
    dist.all_to_all_single(torch.empty_like(x), x)  # sets up the transport
    recv = [rows] * world
    if rank == 0:
        recv[1] = rows + 1
    got = torch.full((sum(recv), 1), -1.0, device="cuda")
    dist.all_to_all_single(got, x, recv, [rows] * world)
    torch.cuda.synchronize()
    out: dict = {}
    parts = torch.split(got, recv)
    out["others_exact"] = all(
        torch.equal(parts[s], want[s * rows : (s + 1) * rows]) for s in range(world) if
        not (rank == 0 and s == 1)
    )  # fmt: skip
    out["untouched"] = rank != 0 or bool((parts[1] == -1).all())
    error = ""
    y = torch.empty_like(x)
    try:
        dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
    except RuntimeError as e:
        error = str(e)
    out["error"] = error
    z = torch.empty_like(x)
    dist.all_to_all_single(z, x)
    torch.cuda.synchronize()
    out["after_exact"] = torch.equal(z, want) and (rank == 0 or torch.equal(y, want))
    return out


def test_all_to_all_split_mismatch_is_reported_not_hung() -> None:
    results = run_distributed(_split_mismatch, gpu_world_size(), backend="ep", timeout=120)
    for rank, out in enumerate(results):
        assert out["others_exact"] and out["untouched"] and out["after_exact"], (rank, out)
        if rank == 0:
            assert "expected 16388 bytes from rank 1, which sent 16384" in out["error"], out
        else:
            assert out["error"] == "", (rank, out)


def _async_and_graph(rank: int, world: int) -> dict:
    out: dict = {}
    n = 1 << 16
    x = torch.arange(world * n, dtype=torch.float32, device="cuda") + rank * 1e6
    want = torch.cat([torch.arange(rank * n, (rank + 1) * n, device="cuda") + s * 1e6
                      for s in range(world)])  # fmt: skip
    dist.all_to_all_single(torch.empty_like(x), x)  # sets up the transport
    torch.cuda.synchronize()
    # async_op: a long producer on the current stream; the call returns at once, wait() orders
    # the current stream behind the kernel, no host sync anywhere
    y = torch.empty_like(x)
    src = torch.zeros_like(x)
    torch.cuda._sleep(200_000_000)
    src.copy_(x)
    t0 = time.perf_counter()
    work = dist.all_to_all_single(y, src, async_op=True)
    t1 = time.perf_counter()
    work.wait()
    out["host_s"] = time.perf_counter() - t0
    out["call_s"], out["wait_s"] = t1 - t0, out["host_s"] - (t1 - t0)  # which one blocks
    torch.cuda.synchronize()
    out["async_ok"] = torch.equal(y, want)
    # CUDA graph: equal splits, captured once, replayed with new inputs
    static_in = x.clone()
    static_out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dist.all_to_all_single(static_out, static_in)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_to_all_single(static_out, static_in)
    ok = True
    for k in range(3):
        static_in.copy_(x + k)
        graph.replay()
        ok = ok and torch.equal(static_out, want + k)
    torch.cuda.synchronize()
    out["graph_ok"] = ok
    return out


def test_all_to_all_async_and_graph() -> None:
    results = run_distributed(_async_and_graph, gpu_world_size(), backend="ep", timeout=300)
    for out in results:
        assert out["async_ok"] and out["graph_ok"], out
    # Neither the call nor wait() waits for the producer (about 0.1 s of GPU sleep) on the host.
    assert all(out["host_s"] < 0.05 for out in results), [
        (round(o["call_s"], 4), round(o["wait_s"], 4)) for o in results
    ]


def _device_splits(rank: int, world: int) -> dict:
    out: dict = {}
    gen = torch.Generator(device="cuda").manual_seed(rank)
    for experts in (1, 4):
        for it in range(6):
            g = torch.Generator().manual_seed(100 * experts + it)
            # [src][dst * E + e], the same on every rank; big enough for several chunks
            table = torch.randint(0, 900 if it % 2 else 5, (world, world * experts), generator=g)
            table[0, 0] = 0
            splits = [row.cuda() for row in table]
            inputs = [None] * world
            x = _random_rows(int(table[rank].sum()) + 3, 24, torch.bfloat16, gen)
            gathered = [None] * world
            dist.all_gather_object(gathered, x.cpu())
            inputs = [t for t in gathered]
            rows, want_splits, want_offsets = reference.all_to_all_v_2d(
                inputs, [s.cpu() for s in splits], experts
            )[rank]
            cap = int(table.sum())  # enough for any rank
            if experts == 1:
                got, got_splits, got_offsets = ep_backend.all_to_all_v(
                    x, splits[rank], capacity=cap
                )
                want_splits, want_offsets = want_splits.view(-1), want_offsets.view(-1)
            else:
                got, got_splits, got_offsets = ep_backend.all_to_all_v_2d(
                    x, splits[rank], experts, capacity=cap
                )
            n = rows.shape[0]
            key = f"E{experts}_{it}"
            out[key] = (
                torch.equal(_bits(got[:n].cpu()), _bits(rows))
                and torch.equal(got_splits.cpu(), want_splits)
                and torch.equal(got_offsets.cpu(), want_offsets)
            )
    # overflow: rank 0's output is one row short; it writes nothing and raises at the check
    splits = torch.full((world,), 4, dtype=torch.int64, device="cuda")
    x = _random_rows(4 * world, 8, torch.float32, gen)
    dest = torch.full((4 * world - (1 if rank == 0 else 0), 8), -7.0, device="cuda")
    ep_backend.all_to_all_v(x, splits, dest)
    try:
        ep_backend.all_to_all_check()
        out["overflow_raised"] = False
    except ep_backend.MoEInputError as e:
        out["overflow_raised"] = "capacity" in str(e)
    out["untouched"] = bool((dest == -7.0).all()) if rank == 0 else True
    dist.barrier()
    # graph capture with device splits that change between replays (no host sync)
    static_splits = torch.zeros(world, dtype=torch.int64, device="cuda")
    static_x = _random_rows(64 * world, 16, torch.float16, gen)
    static_out = torch.empty((64 * world * world, 16), dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ep_backend.all_to_all_v(static_x, static_splits, static_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, rs, ro = ep_backend.all_to_all_v(static_x, static_splits, static_out)
    ok = True
    for k in range(3):
        table = torch.randint(0, 64, (world, world), generator=torch.Generator().manual_seed(k))
        static_splits.copy_(table[rank])
        graph.replay()
        gathered = [None] * world
        dist.all_gather_object(gathered, static_x.cpu())
        rows, want_splits, _ = reference.all_to_all_v_2d(gathered, list(table), 1)[rank]
        ok = ok and torch.equal(_bits(static_out[: rows.shape[0]].cpu()), _bits(rows))
        ok = ok and torch.equal(rs.cpu(), want_splits.view(-1))
    out["graph_ok"] = ok
    return out


def test_all_to_all_v_device_splits() -> None:
    res = run_distributed(_device_splits, gpu_world_size(), backend="ep", timeout=300)
    for rank, out in enumerate(res):
        assert out.pop("overflow_raised") == (rank == 0), (rank, out)
        assert all(out.values()), (rank, out)
