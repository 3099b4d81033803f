"""Registration of "ep" and process-group creation in the ways users create groups."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

import ep_backend


def test_backend_is_registered_for_cpu_and_cuda() -> None:
    assert "EP" in dist.Backend._plugins
    assert dist.Backend._plugins["EP"].extended_api is True
    assert dist.Backend.backend_capability["ep"] == ["cpu", "cuda"]
    assert dist.Backend("ep") == "ep"
    ep_backend.register()  # idempotent
    assert list(dist.Backend._plugins).count("EP") == 1


def test_extension_uses_the_process_shared_cxx_runtime() -> None:
    """_C carries no private copy of libstdc++ (a static one crashed in the first ostream use)."""
    import shutil

    nm = shutil.which("nm")
    assert nm is not None, "binutils' nm is needed (the build needs binutils anyway)"
    import importlib

    lib = importlib.import_module("ep_backend._C").__file__
    symbols = subprocess.run([nm, "-D", "--defined-only", lib], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    # std::ostream::_M_insert<long>: explicitly instantiated inside libstdc++ only
    assert "_ZNSo9_M_insertIlEERSoT_" not in symbols, f"{lib} embeds libstdc++"


def test_options_validate_and_copy() -> None:
    import copy

    opts = ep_backend.Options(timeout=datetime.timedelta(seconds=5), num_sms=16)
    assert opts.num_sms == 16 and opts.timeout == datetime.timedelta(seconds=5)
    clone = copy.deepcopy(opts)
    clone.num_sms = 8
    assert opts.num_sms == 16 and clone.num_sms == 8
    with pytest.raises(RuntimeError, match="num_sms must be positive"):
        ep_backend.Options(num_sms=0)
    with pytest.raises(RuntimeError, match="kernel_timeout_s"):
        ep_backend.Options(kernel_timeout_s=-1.0)
    assert opts.overlap_dispatch_host_wait is True  # the default
    assert ep_backend.Options().recv_slabs == 2
    assert "recv_slabs=0" in repr(ep_backend.Options(recv_slabs=0))
    with pytest.raises(RuntimeError, match="recv_slabs must be in"):
        ep_backend.Options(recv_slabs=65)
    exact = ep_backend.Options(overlap_dispatch_host_wait=False)
    assert copy.deepcopy(exact).overlap_dispatch_host_wait is False
    assert "overlap_dispatch_host_wait=False" in repr(exact)


def _basic(rank: int, world_size: int) -> dict:
    backend = ep_backend.get_backend()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {
        "name": dist.get_backend(),
        "backend_name": backend.name(),
        "sum": t.tolist(),
        "type": type(backend).__name__,
        "num_sms": backend.options.num_sms,
    }


def test_init_with_explicit_store_through_run_distributed() -> None:
    out = run_distributed(_basic, 2, backend="ep")
    for r in out:
        assert r["name"] == "ep" and r["backend_name"] == "ep"
        assert r["type"] == "EPProcessGroup"
        assert r["sum"] == [3.0, 3.0, 3.0]


def _env_init(rank: int, world_size: int, port: int, num_sms: int) -> list[float]:
    import ep_backend as epb

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )  # fmt: skip
    dist.init_process_group(
        "ep", init_method="env://", pg_options=epb.Options(num_sms=num_sms),
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        assert epb.get_backend().options.num_sms == num_sms
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.tolist()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_env_under_mp_spawn_with_pg_options(tmp_path) -> None:
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.start_processes(
        _env_init, args=(2, port, 12), nprocs=2, join=False, start_method="spawn"
    )
    deadline = 120
    import time

    start = time.monotonic()
    while not ctx.join(timeout=5):
        assert time.monotonic() - start < deadline, "mp.spawn workers hung"


def test_init_under_torchrun(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            import ep_backend
            dist.init_process_group("ep")
            t = torch.ones(2) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            assert t.tolist() == [3.0, 3.0], t
            g = dist.new_group([0, 1])
            dist.all_reduce(t, group=g)
            assert t.tolist() == [6.0, 6.0], t
            print("TORCHRUN_OK", dist.get_rank(), flush=True)
            dist.destroy_process_group()
            """
        )
    )
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("TORCHRUN_OK") == 2


def _groups_and_mesh(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    out["pair_sum"] = t.item()
    assert dist.get_backend(mine) == "ep"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    dp = mesh.get_group("dp")
    a = torch.tensor([float(rank)])
    dist.all_reduce(a, group=tp)
    b = torch.tensor([float(rank)])
    dist.all_reduce(b, group=dp)
    out["tp"], out["dp"] = a.item(), b.item()
    out["tp_backend"] = dist.get_backend(tp)
    # subgroup backends are full "ep" backends too
    assert type(ep_backend.get_backend(tp)).__name__ == "EPProcessGroup"
    return out


def test_new_group_and_device_mesh_on_four_ranks() -> None:
    out = run_distributed(_groups_and_mesh, 4, backend="ep")
    for rank, r in enumerate(out):
        assert r["pair_sum"] == (2.0 if rank % 2 == 0 else 4.0)
        # mesh [[0,1],[2,3]]: tp groups are rows, dp groups are columns
        assert r["tp"] == (1.0 if rank < 2 else 5.0)
        assert r["dp"] == (2.0 if rank % 2 == 0 else 4.0)
        assert r["tp_backend"] == "ep"


def _timeout_and_shutdown(rank: int, world_size: int) -> dict:
    backend = ep_backend.get_backend()
    backend.set_timeout(datetime.timedelta(seconds=42))
    seq_before = backend._get_sequence_number_for_group()
    dist.barrier()
    t = torch.ones(1)
    dist.broadcast(t, 0)
    seq_after = backend._get_sequence_number_for_group()
    g = dist.new_group([0, 1])
    gb = ep_backend.get_backend(g)
    dist.destroy_process_group(g)
    shut = gb.is_shutdown
    with pytest.raises(RuntimeError, match="shut down"):
        gb.allreduce([torch.ones(1)]).wait()
    return {
        "timeout": backend.options.timeout.total_seconds(),
        "seq": seq_after - seq_before,
        "shut": shut,
    }


def test_set_timeout_sequence_numbers_and_shutdown() -> None:
    for r in run_distributed(_timeout_and_shutdown, 2, backend="ep"):
        assert r["timeout"] == 42.0
        assert r["seq"] >= 2
        assert r["shut"] is True


def _unsupported(rank: int, world_size: int) -> None:
    backend = ep_backend.get_backend()
    with pytest.raises(RuntimeError, match="does not support"):
        backend.recv_anysource([torch.ones(2, device="meta")], 0)
    with pytest.raises(RuntimeError, match="ep: all_to_all_single does not support tensors on"):
        backend.alltoall_base(torch.ones(2, device="meta"), torch.ones(2, device="meta"), [], [])
    # Neither rank leaves while its peer may still be connecting the group's inner backends.
    dist.barrier()


def test_unsupported_calls_raise_clear_errors() -> None:
    run_distributed(_unsupported, 2, backend="ep")


def _abort_subgroup(rank: int, world_size: int) -> dict:
    from torch.distributed.distributed_c10d import _abort_process_group

    g = dist.new_group([0, 1])
    gb = ep_backend.get_backend(g)
    t = torch.ones(2)
    dist.all_reduce(t, group=g)
    _abort_process_group(g)
    aborted = gb.is_shutdown
    # the default group is untouched by aborting a subgroup
    u = torch.ones(1)
    dist.all_reduce(u)
    return {"sum": t.tolist(), "aborted": aborted, "world": u.item()}


def test_abort_subgroup_leaves_world_usable() -> None:
    for r in run_distributed(_abort_subgroup, 2, backend="ep"):
        assert r == {"sum": [2.0, 2.0], "aborted": True, "world": 2.0}


def _drop_group_with_op_in_flight(rank: int, world_size: int) -> float:
    from torch.distributed.distributed_c10d import _abort_process_group

    g = dist.new_group([0, 1])
    gb = ep_backend.get_backend(g)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)  # rank 1's all-reduce is still running when it drops the group
    t = torch.ones(1 << 12)
    work = dist.all_reduce(t, group=g, async_op=True)
    # Only the Gloo worker now holds t: freeing it there needs the GIL, and our holder must not
    # keep the GIL while the group's destructor joins that worker (this deadlocked once).
    del t, work
    _abort_process_group(g)
    del g, gb
    u = torch.ones(1)
    dist.all_reduce(u)
    return u.item()


def test_dropping_a_group_with_an_op_in_flight_does_not_deadlock() -> None:
    assert run_distributed(_drop_group_with_op_in_flight, 2, backend="ep", timeout=60) == [2.0, 2.0]


def _debug_detail(rank: int, world_size: int) -> dict:
    from ep_backend import reference

    t = torch.ones(2)
    dist.all_reduce(t)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 64, generator=g).bfloat16()
    idx = torch.randint(-1, 4, (8, 2), generator=g)
    out = ep_backend.dispatch(x, idx, None, 4)
    ref = reference.dispatch(x, idx, None, 4)
    combined = ep_backend.combine(out.recv_x, out.handle).combined_x
    expected = reference.combine(ref.recv_x, ref.handle).combined_x
    wrapped = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    return {
        "sum": t.tolist(),
        "dispatch": torch.equal(out.recv_x, ref.recv_x),
        "combine": torch.equal(combined, expected),
        "wrapped": wrapped,
        "backend": type(ep_backend.get_backend()).__name__,
    }


def test_works_under_torch_distributed_debug_detail() -> None:
    res = run_distributed(_debug_detail, 2, backend="ep", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    for r in res:
        assert r["wrapped"] == "_ProcessGroupWrapper"  # torch really wrapped our backend
        assert r == {**r, "sum": [2.0, 2.0], "dispatch": True, "combine": True,
                     "backend": "EPProcessGroup"}  # fmt: skip
