"""all-to-all on CUDA tensors through ep's NVLink kernel with more ranks than GPUs (rank r on GPU
r % count; ranks sharing a GPU reach each other over CUDA IPC within the device), so that 3 and 4
ranks, with 2 and 3 peers per sender, run on a one-GPU machine too. NCCL cannot run there (it
refuses two ranks on one GPU): the expected rows are built from the inputs' formula instead.
Host splits, ``all_to_all_v`` and ``all_to_all_v_2d``, 14 calls in a row with random splits
(zeros included) of up to 200 KiB a pair (flagged lines) or 8 MiB (staging rings); then
``all_to_all_v`` replayed from a CUDA graph with new splits, and with ``async_op``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

import ep_backend

WIDTH = 512  # int32 per row: 2 KiB
CALLS = 14


def _rows(source: int, call: int, n: int) -> torch.Tensor:
    """int32 ``[n, WIDTH]`` distinct per (source, call, element)."""
    base = (source * 7919 + call * 104729) % 1000003
    r = torch.arange(n * WIDTH, dtype=torch.int64).view(n, WIDTH)
    return ((r * 31 + base) % 2147483647).to(torch.int32)


def _shared_gpu(rank: int, world: int) -> list[str]:
    dev = torch.device("cuda", torch.cuda.current_device())
    failures: list[str] = []
    for call in range(CALLS):
        g = torch.Generator().manual_seed(call)
        most = 100 if call % 3 == 0 else 4096  # rows a pair: flagged lines, else the rings
        m = torch.randint(0, most + 1, (world, world), generator=g)  # [source][destination]
        m[
            torch.randint(0, world, (1,), generator=g), torch.randint(0, world, (1,), generator=g)
        ] = 0
        inputs = [_rows(s, call, int(m[s].sum())) for s in range(world)]
        want = torch.cat([inputs[s][int(m[s, :rank].sum()) : int(m[s, : rank + 1].sum())]
                          for s in range(world)])  # fmt: skip
        x = inputs[rank].to(dev)
        recv = m[:, rank].tolist()
        out = torch.empty(sum(recv), WIDTH, dtype=torch.int32, device=dev)
        dist.all_to_all_single(out, x, recv, m[rank].tolist())
        if not torch.equal(out.cpu(), want):
            failures.append(f"call {call}: all_to_all_single rows differ")
        got, got_splits, got_offsets = ep_backend.all_to_all_v(
            x, m[rank].to(dev), capacity=world * most
        )
        offsets = [sum(recv[:s]) for s in range(world)]
        if not torch.equal(got[: sum(recv)].cpu(), want) or got_splits.cpu().tolist() != recv:
            failures.append(f"call {call}: all_to_all_v rows or splits differ")
        if got_offsets.shape != (world,) or got_offsets.cpu().tolist() != offsets:
            failures.append(f"call {call}: all_to_all_v offsets {got_offsets} != {offsets}")
        experts = 2
        sp = torch.randint(0, most // 2 + 1, (world, world * experts), generator=g)
        inputs = [_rows(s, call + CALLS, int(sp[s].sum())) for s in range(world)]
        parts = []
        for e in range(experts):  # grouped by local expert, then by source
            for s in range(world):
                start = int(sp[s, : rank * experts + e].sum())
                parts.append(inputs[s][start : start + int(sp[s, rank * experts + e])])
        want = torch.cat(parts)
        # [E, R]: rows of local expert e from source s, and their first output row
        want_splits = sp[:, rank * experts : (rank + 1) * experts].t().contiguous()
        want_offsets = (want_splits.reshape(-1).cumsum(0) - want_splits.reshape(-1)).view(
            experts, world
        )
        got, got_splits, got_offsets = ep_backend.all_to_all_v_2d(
            inputs[rank].to(dev), sp[rank].to(dev), experts, capacity=world * most
        )
        if not torch.equal(got[: want.shape[0]].cpu(), want):
            failures.append(f"call {call}: all_to_all_v_2d rows differ")
        if not (torch.equal(got_splits.cpu(), want_splits)
                and torch.equal(got_offsets.cpu(), want_offsets)):  # fmt: skip
            failures.append(f"call {call}: all_to_all_v_2d splits or offsets differ")
    failures += _graph_and_async(rank, world, dev)
    torch.cuda.synchronize()
    transport = ep_backend.get_backend().all_to_all_transport
    if transport != "nvlink":
        failures.append(f"the all-to-all ran on {transport!r}, not ep's NVLink kernel")
    return failures


def _graph_and_async(rank: int, world: int, dev: torch.device) -> list[str]:
    """all_to_all_v captured in a CUDA graph with splits that change between replays (no host
    sync), then the same call with async_op."""
    failures: list[str] = []
    most = 64
    inputs = [_rows(s, 2 * CALLS, world * most) for s in range(world)]
    static_x = inputs[rank].to(dev)
    static_splits = torch.zeros(world, dtype=torch.int64, device=dev)
    static_out = torch.empty((world * world * most, WIDTH), dtype=torch.int32, device=dev)

    def expected(table: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        rows = [inputs[s][int(table[s, :rank].sum()) : int(table[s, : rank + 1].sum())]
                for s in range(world)]  # fmt: skip
        return torch.cat(rows), table[:, rank].tolist()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # an eager call first: the transport is set up outside capture
        ep_backend.all_to_all_v(static_x, static_splits, static_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, rs, ro = ep_backend.all_to_all_v(static_x, static_splits, static_out)
    # A CPU all-reduce (Gloo) between replays: a peer's next replay writes into this rank's
    # static_out, which must wait until this rank has read it.
    step = torch.zeros(1)
    for k in range(3):
        dist.all_reduce(step)
        table = torch.randint(
            0, most + 1, (world, world), generator=torch.Generator().manual_seed(k)
        )
        static_splits.copy_(table[rank])
        graph.replay()
        torch.cuda.synchronize()
        want, recv = expected(table)
        if not torch.equal(static_out[: want.shape[0]].cpu(), want) or rs.cpu().tolist() != recv:
            failures.append(f"graph replay {k}: all_to_all_v rows or splits differ")
        if ro.cpu().tolist() != [sum(recv[:s]) for s in range(world)]:
            failures.append(f"graph replay {k}: all_to_all_v offsets differ")
    table = torch.randint(0, most + 1, (world, world), generator=torch.Generator().manual_seed(9))
    got, got_splits, _, work = ep_backend.all_to_all_v(
        static_x, table[rank].to(dev), capacity=world * most, async_op=True
    )
    work.wait()
    want, recv = expected(table)
    if not torch.equal(got[: want.shape[0]].cpu(), want) or got_splits.cpu().tolist() != recv:
        failures.append("async_op: all_to_all_v rows or splits differ")
    return failures


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("world", [3, 4])
def test_all_to_all_with_ranks_sharing_gpus(world: int) -> None:
    for rank, failures in enumerate(run_distributed(_shared_gpu, world, backend="ep", timeout=300)):
        assert failures == [], (rank, failures)
