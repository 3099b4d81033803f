"""Standard collectives on CUDA tensors through "ep" (2+ GPUs), including stream semantics.

One rank per GPU (``gpu_world_size``: EP4 on a 4-GPU machine), or ``EP_TEST_WORLD_SIZE`` ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist_utils import gpu_world_size, run_distributed

pytestmark = pytest.mark.gpu(min_gpus=2)


def _data(rank: int, n: int = 1024, device: str = "cuda") -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32, device=device) * 0.5 + rank * 10 + 1


def _cuda_collectives(rank: int, world: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    out: dict = {}
    total = sum(_data(r) for r in range(world))
    t = _data(rank)
    dist.all_reduce(t)
    out["all_reduce"] = torch.equal(t, total)
    t = _data(rank)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["avg"] = torch.allclose(t, total / world)
    t = _data(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    out["premul"] = torch.allclose(t, total * 0.5)
    t = _data(rank)
    dist.broadcast(t, src=1)
    out["broadcast"] = torch.equal(t, _data(1))
    flat = torch.empty(1024 * world, device=dev)
    dist.all_gather_into_tensor(flat, _data(rank))
    out["all_gather_into_tensor"] = torch.equal(flat, torch.cat([_data(r) for r in range(world)]))
    o = torch.empty(512, device=dev)
    dist.reduce_scatter_tensor(o, _data(rank, 512 * world), op=dist.ReduceOp.AVG)
    exp = sum(_data(r, 512 * world) for r in range(world))[512 * rank : 512 * (rank + 1)] / world
    out["reduce_scatter_tensor_avg"] = torch.allclose(o, exp)
    inp = torch.arange(world * 4, dtype=torch.float32, device=dev) + 100 * rank
    o = torch.empty(world * 4, device=dev)
    dist.all_to_all_single(o, inp)
    exp = torch.cat([torch.arange(4, device=dev) + 4 * rank + 100 * s for s in range(world)])
    out["all_to_all_single"] = torch.equal(o, exp.float())
    gl = [torch.empty(1024, device=dev) for _ in range(world)]
    dist.all_gather(gl, _data(rank))
    out["all_gather"] = all(torch.equal(gl[r], _data(r)) for r in range(world))
    peer = rank ^ 1
    if peer < world:
        r2 = torch.empty(1024, device=dev)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, _data(rank), peer), dist.P2POp(dist.irecv, r2, peer)]
        )
        for q in reqs:
            q.wait()
        out["batch_isend_irecv"] = torch.equal(r2, _data(peer))
    objs: list = [None] * world
    dist.all_gather_object(objs, rank)  # CPU side of the same group
    out["object"] = objs == list(range(world))
    cpu = torch.ones(3) * rank
    dist.all_reduce(cpu)
    out["cpu_tensor_on_same_group"] = cpu.tolist() == [float(sum(range(world)))] * 3
    dist.barrier()
    torch.cuda.synchronize()
    return out


def test_cuda_collectives() -> None:
    for out in run_distributed(_cuda_collectives, gpu_world_size(), backend="ep"):
        assert all(out.values()), out


def _stream_semantics(rank: int, world: int) -> dict:
    """Producer on a side stream, async all_reduce, wait(), consumer: no host sync anywhere.

    The producer is one long kernel (torch.cuda._sleep: ~1 s of clock cycles). The collective
    cannot start before it ends, so all_reduce + wait() returning in milliseconds proves that
    neither blocked the host on the collective; the consumer's data proves the stream ordering.
    """
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device=dev)
    dist.all_reduce(t)  # the first collective creates the NCCL communicator (host-blocking)
    torch.cuda.synchronize()
    # The consumer's output exists before: a fresh allocation on `side` could cudaMalloc, which
    # may synchronise the device (it did on the GPU VM) and would be the test's own host sync.
    consumer = torch.empty_like(t)
    side.wait_stream(torch.cuda.current_stream())
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        begin.record()
        torch.cuda._sleep(2_000_000_000)  # producer
        end.record()
        t.fill_(float(rank + 1))
        start = time.perf_counter()
        work = dist.all_reduce(t, async_op=True)
        work.wait()  # makes `side` wait on the collective; must not block the CPU
        host_wait_s = time.perf_counter() - start
        torch.mul(t, 2, out=consumer)
    # Informational: on the GPU VM the step after wait() (launching the consumer or querying the
    # stream) was once seen to block until the producer ended; wait() itself returned at once.
    side_busy = not side.query()
    issued_s = time.perf_counter() - start
    torch.cuda.current_stream().wait_stream(side)
    expected = float(sum(range(1, world + 1)) * 2)
    ok = bool((consumer == expected).all().item())
    fut_val = work.get_future().wait()[0]
    return {
        "producer_gpu_ms": begin.elapsed_time(end),
        "issued_s": issued_s,
        "ok": ok,
        "host_wait_s": host_wait_s,
        "gpu_busy_when_cpu_returned": side_busy,
        "future_ok": bool((fut_val == expected / 2).all().item()),
    }


def test_async_stream_semantics_without_host_sync() -> None:
    for out in run_distributed(_stream_semantics, gpu_world_size(), backend="ep"):
        assert out["ok"] and out["future_ok"], out
        assert out["producer_gpu_ms"] > 500, out  # the producer really held the stream
        # all_reduce + wait() returned long before the collective could even start
        assert out["host_wait_s"] < 0.05, out


def _device_id_mesh_split(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import ep_backend

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    out: dict = {"bound": str(dist.group.WORLD.bound_device_id)}
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    g = mesh.get_group("ep")
    t = torch.ones(4, device=dev) * (rank + 1)
    dist.all_reduce(t, group=g)
    out["mesh_sum"] = t.tolist()
    sub = dist.split_group(split_ranks=[[r] for r in range(world)])
    t = torch.ones(2, device=dev) * (rank + 1)
    dist.all_reduce(t, group=sub)
    out["split_single_rank_sum"] = t.tolist()
    out["split_backend"] = type(ep_backend.get_backend(sub)).__name__
    ng = dist.new_group(list(range(world)))
    t = torch.ones(2, device=dev)
    dist.all_reduce(t, group=ng)
    out["new_group_sum"] = t.tolist()
    return out


def test_device_id_device_mesh_and_split_group() -> None:
    world = gpu_world_size()
    res = run_distributed(
        _device_id_mesh_split, world, backend="ep", env={"EP_TEST_BIND_DEVICE": "1"}
    )
    for rank, out in enumerate(res):
        assert out["bound"] == f"cuda:{rank % torch.cuda.device_count()}"
        assert out["mesh_sum"] == [float(world * (world + 1) // 2)] * 4
        assert out["split_single_rank_sum"] == [float(rank + 1)] * 2
        assert out["split_backend"] == "EPProcessGroup"
        assert out["new_group_sum"] == [float(world)] * 2


def _ddp_cuda(rank: int, world: int) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 8).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(16, 64, generator=g).cuda()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_ddp_on_cuda_matches_nccl() -> None:
    ep = run_distributed(_ddp_cuda, gpu_world_size(), backend="ep")
    nccl = run_distributed(_ddp_cuda, gpu_world_size(), backend="nccl")
    for a, b in zip(ep[0], nccl[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ep[0], ep[1], strict=True):
        assert torch.equal(a, b)
