"""Every standard collective on CPU tensors through "ep", checked against Gloo and by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed


def _data(rank: int, n: int = 6, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * 0.5 + rank * 10 + 1).to(dtype)


def _standard_collectives(rank: int, world: int) -> dict:
    """Runs the collectives Gloo supports too, so "ep" and "gloo" results can be compared."""
    out: dict = {}
    t = _data(rank)
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = t
    for op in ("SUM", "MAX", "MIN", "PRODUCT"):
        t = _data(rank)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = t
    t = _data(rank, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BOR)
    out["all_reduce_BOR"] = t
    t = _data(rank)
    dist.reduce(t, dst=1)
    out["reduce"] = t
    gathered = [torch.empty(6) for _ in range(world)]
    dist.all_gather(gathered, _data(rank))
    out["all_gather"] = torch.stack(gathered)
    flat = torch.empty(6 * world)
    dist.all_gather_into_tensor(flat, _data(rank))
    out["all_gather_into_tensor"] = flat
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["all_gather_object"] = objs
    bl = [rank * 3 if rank == 0 else None]
    dist.broadcast_object_list(bl, src=0)
    out["broadcast_object_list"] = bl
    gl = [torch.empty(6) for _ in range(world)] if rank == 0 else None
    dist.gather(_data(rank), gl, dst=0)
    out["gather"] = torch.stack(gl) if gl is not None else None
    recv = torch.empty(6)
    sl = [_data(r) * 2 for r in range(world)] if rank == 0 else None
    dist.scatter(recv, sl, src=0)
    out["scatter"] = recv
    o = torch.empty(6)
    dist.reduce_scatter(o, [_data(rank) + r for r in range(world)])
    out["reduce_scatter"] = o
    o = torch.empty(3)
    dist.reduce_scatter_tensor(o, torch.cat([_data(rank, 3) * (r + 1) for r in range(world)]))
    out["reduce_scatter_tensor"] = o
    # all_to_all_single: even and uneven splits
    inp = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    o = torch.empty(world * 2)
    dist.all_to_all_single(o, inp)
    out["all_to_all_single"] = o
    in_splits = [(rank + d) % 3 for d in range(world)]
    out_splits = [(s + rank) % 3 for s in range(world)]
    inp = torch.arange(sum(in_splits), dtype=torch.float32) + 100 * rank
    o = torch.empty(sum(out_splits))
    dist.all_to_all_single(o, inp, out_splits, in_splits)
    out["all_to_all_single_uneven"] = o
    outs = [torch.empty(2) for _ in range(world)]
    ins = [torch.full((2,), float(rank * 10 + d)) for d in range(world)]
    torch_version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if dist.get_backend() == "gloo" and torch_version < (2, 13):
        # The Gloo reference of torch < 2.13 has no list all_to_all (ep emulates it): the same
        # exchange as one all_to_all_single.
        flat = torch.empty(2 * world)
        dist.all_to_all_single(flat, torch.cat(ins))
        outs = list(flat.split(2))
    else:
        dist.all_to_all(outs, ins)
    out["all_to_all"] = torch.stack(outs)
    # point to point, blocking and batched (both peers send first: must not deadlock)
    peer = rank ^ 1
    if peer < world:
        if rank % 2 == 0:
            dist.send(_data(rank), dst=peer)
            r = torch.empty(6)
            dist.recv(r, src=peer)
        else:
            r = torch.empty(6)
            dist.recv(r, src=peer)
            dist.send(_data(rank), dst=peer)
        out["send_recv"] = r
        r2 = torch.empty(6)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, _data(rank) * 3, peer), dist.P2POp(dist.irecv, r2, peer)]
        )
        for q in reqs:
            q.wait()
        out["batch_isend_irecv"] = r2
    # coalescing manager without device (Megatron's path): coalesced all_reduce
    ts = [_data(rank, 4), _data(rank, 5) * 2]
    with dist._coalescing_manager(async_ops=False):
        for x in ts:
            dist.all_reduce(x)
    out["coalesced_all_reduce"] = torch.cat(ts)
    ag_outs = [torch.empty(4 * world), torch.empty(2 * world)]
    with dist._coalescing_manager(async_ops=False):
        dist.all_gather_into_tensor(ag_outs[0], _data(rank, 4))
        dist.all_gather_into_tensor(ag_outs[1], _data(rank, 2))
    out["coalesced_all_gather"] = torch.cat(ag_outs)
    rs_outs = [torch.empty(2), torch.empty(3)]
    with dist._coalescing_manager(async_ops=False):
        dist.reduce_scatter_tensor(rs_outs[0], _data(rank, 2 * world))
        dist.reduce_scatter_tensor(rs_outs[1], _data(rank, 3 * world))
    out["coalesced_reduce_scatter"] = torch.cat(rs_outs)
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_standard_collectives_match_gloo(world: int) -> None:
    ep = run_distributed(_standard_collectives, world, backend="ep")
    gloo = run_distributed(_standard_collectives, world, backend="gloo")
    assert len(ep[0]) >= 20
    for rank in range(world):
        assert ep[rank].keys() == gloo[rank].keys()
        for key, expected in gloo[rank].items():
            got = ep[rank][key]
            if isinstance(expected, torch.Tensor):
                assert torch.equal(got, expected), (rank, key, got, expected)
            else:
                assert got == expected, (rank, key)
    # spot checks by hand, so an error shared by both backends cannot hide
    total = sum(_data(r) for r in range(world))
    assert torch.equal(ep[0]["all_reduce_SUM"], total)
    assert torch.equal(ep[1]["broadcast"], _data(world - 1))
    assert torch.equal(ep[1]["reduce"], total)


def _composed_reductions(rank: int, world: int) -> dict:
    """AVG and PREMUL_SUM, which "ep" composes from SUM on CPU (Gloo lacks them)."""
    out: dict = {}
    premul = dist._make_nccl_premul_sum(0.25)
    t = _data(rank)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = t
    t = _data(rank)
    dist.all_reduce(t, op=premul)
    out["all_reduce_premul"] = t
    t = _data(rank)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    fut = work.get_future()
    work.wait()
    out["async_avg"] = t
    out["async_completed"] = work.is_completed()
    out["future_value"] = fut.wait()[0]
    t = _data(rank)
    dist.reduce(t, dst=0, op=dist.ReduceOp.AVG)
    out["reduce_avg"] = t
    t = _data(rank)
    dist.reduce(t, dst=0, op=premul)
    out["reduce_premul"] = t
    inp = torch.cat([_data(rank, 3) * (r + 1) for r in range(world)])
    keep = inp.clone()
    o = torch.empty(3)
    dist.reduce_scatter_tensor(o, inp, op=dist.ReduceOp.AVG)
    out["rs_tensor_avg"] = o
    o = torch.empty(3)
    dist.reduce_scatter_tensor(o, inp, op=premul)
    out["rs_tensor_premul"] = o
    out["input_untouched"] = torch.equal(inp, keep)
    o = torch.empty(6)
    dist.reduce_scatter(o, [_data(rank) + r for r in range(world)], op=dist.ReduceOp.AVG)
    out["rs_list_avg"] = o
    ts = [_data(rank, 4), _data(rank, 5)]
    with dist._coalescing_manager(async_ops=False):
        for x in ts:
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
    out["coalesced_avg"] = torch.cat(ts)
    rs = [torch.empty(2), torch.empty(1)]
    with dist._coalescing_manager(async_ops=False):
        dist.reduce_scatter_tensor(rs[0], _data(rank, 2 * world), op=dist.ReduceOp.AVG)
        dist.reduce_scatter_tensor(rs[1], _data(rank, world), op=dist.ReduceOp.AVG)
    out["coalesced_rs_avg"] = torch.cat(rs)
    with pytest.raises(RuntimeError, match="AVG needs floating-point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_avg_and_premul_sum(world: int) -> None:
    res = run_distributed(_composed_reductions, world, backend="ep")
    total = sum(_data(r) for r in range(world))
    for rank, out in enumerate(res):
        assert torch.allclose(out["all_reduce_avg"], total / world)
        assert torch.allclose(out["all_reduce_premul"], total * 0.25)
        assert torch.allclose(out["async_avg"], total / world)
        assert out["async_completed"]
        assert torch.allclose(out["future_value"], total / world)
        if rank == 0:
            assert torch.allclose(out["reduce_avg"], total / world)
            assert torch.allclose(out["reduce_premul"], total * 0.25)
        else:  # non-root tensors keep their values
            assert torch.equal(out["reduce_avg"], _data(rank))
            assert torch.equal(out["reduce_premul"], _data(rank))
        chunk = sum(_data(r, 3) * (rank + 1) for r in range(world))
        assert torch.allclose(out["rs_tensor_avg"], chunk / world)
        assert torch.allclose(out["rs_tensor_premul"], chunk * 0.25)
        assert out["input_untouched"]
        assert torch.allclose(
            out["rs_list_avg"], sum(_data(r) + rank for r in range(world)) / world
        )
        exp = torch.cat(
            [sum(_data(r, 4) for r in range(world)), sum(_data(r, 5) for r in range(world))]
        )
        assert torch.allclose(out["coalesced_avg"], exp / world)
        exp_rs = torch.cat(
            [
                sum(_data(r, 2 * world) for r in range(world))[2 * rank : 2 * rank + 2],
                sum(_data(r, world) for r in range(world))[rank : rank + 1],
            ]
        )
        assert torch.allclose(out["coalesced_rs_avg"], exp_rs / world)


def _async_ops(rank: int, world: int) -> dict:
    works = []
    ts = [_data(rank) * (i + 1) for i in range(4)]
    for t in ts:
        works.append(dist.all_reduce(t, async_op=True))
    flat = torch.empty(6 * world)
    works.append(dist.all_gather_into_tensor(flat, _data(rank), async_op=True))
    for w in works:
        w.wait()
    return {"ts": torch.stack(ts), "flat": flat, "done": all(w.is_completed() for w in works)}


def test_async_op_wait_and_is_completed() -> None:
    res = run_distributed(_async_ops, 2, backend="ep")
    total = _data(0) + _data(1)
    for out in res:
        assert out["done"]
        assert torch.equal(out["ts"], torch.stack([total * (i + 1) for i in range(4)]))
        assert torch.equal(out["flat"], torch.cat([_data(0), _data(1)]))


def _functional(rank: int, world: int) -> dict:
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    ag = funcol.all_gather_tensor(_data(rank), 0, group).wait()
    ar = funcol.all_reduce(_data(rank), "sum", group).wait()
    rs = funcol.reduce_scatter_tensor(_data(rank, 2 * world), "sum", 0, group).wait()
    a2a = funcol.all_to_all_single(
        torch.arange(world, dtype=torch.float32) + rank, None, None, group
    )
    return {"ag": ag, "ar": ar, "rs": rs, "a2a": a2a.wait() if hasattr(a2a, "wait") else a2a}


def test_functional_collectives() -> None:
    res = run_distributed(_functional, 2, backend="ep")
    for rank, out in enumerate(res):
        assert torch.equal(out["ag"], torch.cat([_data(0), _data(1)]))
        assert torch.equal(out["ar"], _data(0) + _data(1))
        assert torch.equal(out["rs"], (_data(0, 4) + _data(1, 4))[2 * rank : 2 * rank + 2])
        assert torch.equal(out["a2a"], torch.tensor([float(rank), float(rank + 1)]))
