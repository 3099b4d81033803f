"""all-to-all on CPU tensors through "ep" (Gloo): dist.all_to_all_single / all_to_all with host
splits and ep_backend.all_to_all_v / all_to_all_v_2d with device-side splits, checked against
ep_backend.reference bitwise, for every dtype, random splits including zeros, non-contiguous
inputs, and the overflow / invalid-split errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

import ep_backend
from ep_backend import reference

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]


def _rows(rank: int, n: int, dtype: torch.dtype, width: int = 3, seed: int = 0) -> torch.Tensor:
    """Rows whose bits say where they came from (rank, row), in any dtype."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    values = torch.randint(0, 100, (n, width), generator=g) + 100 * rank
    return values.to(dtype)


def _splits(world: int, experts: int, seed: int, rank: int) -> torch.Tensor:
    """Random splits with zeros: [R * E] int64."""
    g = torch.Generator().manual_seed(7 * seed + rank)
    s = torch.randint(0, 5, (world * experts,), generator=g)
    s[torch.randint(0, world * experts, (2,), generator=g)] = 0
    return s


def _host_split_case(rank: int, world: int) -> dict:
    out: dict = {}
    for i, dtype in enumerate(DTYPES):
        splits = [_splits(world, 1, i, r) for r in range(world)]
        inputs = [_rows(r, int(splits[r].sum()), dtype, seed=i) for r in range(world)]
        expected = reference.all_to_all_v_2d(inputs, splits, 1)[rank][0]
        send = splits[rank].tolist()
        recv = [int(splits[s][rank]) for s in range(world)]
        got = torch.empty((sum(recv), 3), dtype=dtype)
        dist.all_to_all_single(got, inputs[rank], recv, send)
        out[f"single_{dtype}"] = torch.equal(got, expected)
        # the list form: one tensor per peer (Gloo's takes equal sizes only)
        pieces = [_rows(rank, 2, dtype, seed=10 * i + d) for d in range(world)]
        outs = [torch.empty((2, 3), dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, pieces)
        want = [_rows(s, 2, dtype, seed=10 * i + rank) for s in range(world)]
        out[f"list_{dtype}"] = torch.equal(torch.cat(outs), torch.cat(want))
    backend = ep_backend.get_backend()
    out["transport"] = backend.all_to_all_transport
    return out


def test_all_to_all_single_host_splits_cpu() -> None:
    for out in run_distributed(_host_split_case, 3, backend="ep"):
        transport = out.pop("transport")
        assert all(out.values()), out
        assert transport in ("undecided", "aten: built without CUDA")


def _device_split_case(rank: int, world: int, experts: int) -> dict:
    out: dict = {}
    for i, dtype in enumerate(DTYPES):
        splits = [_splits(world, experts, i, r) for r in range(world)]
        # one spare row at the end: the splits need not use every row
        inputs = [_rows(r, int(splits[r].sum()) + 1, dtype, seed=i) for r in range(world)]
        rows, want_splits, want_offsets = reference.all_to_all_v_2d(inputs, splits, experts)[rank]
        x = inputs[rank]
        if i % 2:  # a non-contiguous input with the same values
            x = x.repeat(1, 2)[:, :3]  # row stride 6
            assert x.shape[0] < 2 or not x.is_contiguous()
        cap = sum(int(s.sum()) for s in splits)  # enough for any rank
        if experts == 1:
            got, got_splits, got_offsets = ep_backend.all_to_all_v(x, splits[rank], capacity=cap)
            want_splits, want_offsets = want_splits.view(-1), want_offsets.view(-1)
        else:
            got, got_splits, got_offsets = ep_backend.all_to_all_v_2d(
                x, splits[rank], experts, capacity=cap
            )
        n = rows.shape[0]
        out[f"rows_{dtype}"] = torch.equal(got[:n], rows)
        out[f"splits_{dtype}"] = torch.equal(got_splits, want_splits)
        out[f"offsets_{dtype}"] = torch.equal(got_offsets, want_offsets)
    # async_op on CPU: complete at return, a Work that waits at once
    splits = _splits(world, experts, 99, rank)
    x = _rows(rank, int(splits.sum()), torch.float32)
    result = ep_backend.all_to_all_v_2d(x, splits, experts, async_op=True)
    result[-1].wait()
    out["async_returns_work"] = len(result) == 4
    return out


@pytest.mark.parametrize("experts", [1, 3])
def test_all_to_all_v_device_splits_cpu(experts: int) -> None:
    for out in run_distributed(_device_split_case, 3, experts, backend="ep"):
        assert all(out.values()), out


def _errors_case(rank: int, world: int) -> dict:
    out: dict = {}
    splits = torch.full((world,), 2, dtype=torch.int64)
    x = _rows(rank, 2 * world, torch.float32)
    # rank 0's output holds fewer rows than it receives: it raises and writes nothing; the
    # others are exact
    cap = 2 * world - 1 if rank == 0 else 2 * world
    dest = torch.full((cap, 3), -7.0)
    try:
        ep_backend.all_to_all_v(x, splits, dest)
        out["overflow_raised"] = False
    except ep_backend.MoEInputError as e:
        out["overflow_raised"] = "capacity" in str(e)
    out["untouched"] = bool((dest == -7.0).all()) if rank == 0 else True
    # rank 1's splits exceed its input: it sends nothing (its peers get zero rows from it)
    bad = splits.clone()
    if rank == 1:
        bad[0] = 1000
    try:
        got, recv_splits, _ = ep_backend.all_to_all_v(x, bad)
        out["invalid_raised"] = False
        out["zero_from_bad"] = int(recv_splits[1]) == 0
    except ep_backend.MoEInputError as e:
        out["invalid_raised"] = "more than its input" in str(e)
        out["zero_from_bad"] = True
    # and the next valid call is right
    inputs = [_rows(r, 2 * world, torch.float32) for r in range(world)]
    got, _, _ = ep_backend.all_to_all_v(inputs[rank], splits)
    want = reference.all_to_all_v_2d(inputs, [splits] * world, 1)[rank][0]
    out["next_ok"] = torch.equal(got[: want.shape[0]], want)
    return out


def test_all_to_all_v_errors_cpu() -> None:
    res = run_distributed(_errors_case, 3, backend="ep")
    assert res[0]["overflow_raised"] and res[0]["untouched"], res[0]
    assert not res[1]["overflow_raised"] and not res[2]["overflow_raised"], res
    assert res[1]["invalid_raised"], res[1]
    assert not res[0]["invalid_raised"] and res[0]["zero_from_bad"], res[0]
    assert all(r["next_ok"] for r in res), res


def _validation_case(rank: int, world: int) -> dict:
    x = torch.zeros(4, 2)
    errors = {}
    cases = {
        "dtype": lambda: ep_backend.all_to_all_v(x, torch.zeros(world, dtype=torch.int32)),
        "shape": lambda: ep_backend.all_to_all_v(x, torch.zeros(world + 1, dtype=torch.int64)),
        "out_rows": lambda: ep_backend.all_to_all_v(
            x, torch.zeros(world, dtype=torch.int64), torch.zeros(4, 3)
        ),
        "experts": lambda: ep_backend.all_to_all_v_2d(x, torch.zeros(world, dtype=torch.int64), 0),
        "both": lambda: ep_backend.all_to_all_v(
            x, torch.zeros(world, dtype=torch.int64), torch.zeros(4, 2), capacity=3
        ),
    }
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except (TypeError, ValueError) as e:
            errors[name] = type(e).__name__
    return errors


def test_all_to_all_v_validation_cpu() -> None:
    for out in run_distributed(_validation_case, 2, backend="ep"):
        assert out == {
            "dtype": "TypeError",
            "shape": "ValueError",
            "out_rows": "ValueError",
            "experts": "ValueError",
            "both": "ValueError",
        }, out


def test_reference_all_to_all_v_2d_by_hand() -> None:
    # two ranks, two local experts each: rank 0 sends (d0e0: 1, d0e1: 0, d1e0: 2, d1e1: 1)
    a = torch.arange(4).view(4, 1)
    b = torch.arange(10, 13).view(3, 1)
    res = reference.all_to_all_v_2d(
        [a, b], [torch.tensor([1, 0, 2, 1]), torch.tensor([0, 1, 1, 1])], 2
    )
    rows1, splits1, offsets1 = res[1]
    # rank 1, expert 0: a[1:3] from rank 0, b[1:2] from rank 1; expert 1: a[3:4], b[2:3]
    assert rows1.view(-1).tolist() == [1, 2, 11, 3, 12]
    assert splits1.tolist() == [[2, 1], [1, 1]]
    assert offsets1.tolist() == [[0, 2], [3, 4]]
