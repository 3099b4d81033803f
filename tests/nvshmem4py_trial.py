"""Trial of nvshmem4py beside ep's own NVSHMEM runtime (GPU machine, 2+ GPUs).

Usage: python tests/nvshmem4py_trial.py [--order ep-first|n4p-first] [--world N]

Needs the ``nvshmem4py-cu13`` wheel and its cuda-core / cuda-bindings / cuda-pathfinder wheels
(``pip install --no-deps``). One process per GPU. Prints one ``CHECK <name>: ok|FAILED|ERROR``
line per step and ``TRIAL <order>: n passed, m failed`` at the end (rank 0).

Steps (each in a try block, so one failure does not hide the others):
* ``libs``: which ``libnvshmem_host.so`` files the process has mapped (one copy is required for
  the two to share NVSHMEM's state).
* n4p-first: nvshmem4py bootstraps NVSHMEM by a unique id passed through the c10d store,
  allocates a symmetric torch tensor, writes into the peer's copy (``get_peer_tensor``) and
  reads back what the peer wrote; then ep's low-latency dispatch + combine runs on top (its
  runtime calls ``nvshmemx_init_attr`` with NVSHMEM already up) and is checked.
* ep-first: ep's low-latency ops run first (ep's runtime bootstraps NVSHMEM), then nvshmem4py
  is initialised the same way and its symmetric tensor checked.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
}


def _mapped_nvshmem_libs() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if "libnvshmem_host" in line})


def _n4p_init(rank: int, world: int, store: dist.Store) -> None:
    import numpy as np
    import nvshmem.core as nvshmem
    from cuda.core import Device

    dev = Device(rank % torch.cuda.device_count())
    dev.set_current()
    if rank == 0:
        uid = nvshmem.get_unique_id()
        store.set("n4p_uid", uid._data.tobytes())
    else:
        uid = nvshmem.get_unique_id(empty=True)
        uid._data[:] = np.frombuffer(store.get("n4p_uid"), dtype=uid._data.dtype)
    nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")


def _n4p_tensor_check(rank: int, world: int) -> None:
    import nvshmem.core as nvshmem
    import nvshmem.core.interop.torch as n4p_torch

    t = n4p_torch.tensor((1024,), dtype=torch.float32)
    t.fill_(-1.0)
    torch.cuda.synchronize()
    dist.barrier()
    peer = (rank + 1) % world
    remote = n4p_torch.get_peer_tensor(t, peer)
    remote.copy_(torch.arange(1024, device=t.device, dtype=torch.float32) + 1000.0 * rank)
    torch.cuda.synchronize()
    dist.barrier()
    writer = (rank - 1) % world
    expect = torch.arange(1024, device=t.device, dtype=torch.float32) + 1000.0 * writer
    assert torch.equal(t, expect), f"symmetric tensor holds {t[:4].tolist()}..., not the peer's"
    dist.barrier()
    n4p_torch.free_tensor(t)
    del nvshmem


def _ep_low_latency_check(rank: int, world: int) -> None:
    import ep_backend as ep

    T, H, K, E, M = 64, 2048, 4, 4 * world, 128
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda", generator=g)
    d = ep.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    out = ep.low_latency_combine(d.recv_x, idx, w, d.handle)
    torch.cuda.synchronize()
    # Identity experts: every token comes back as sum_k w_k * x.
    expect = x.float() * w.sum(1, keepdim=True)
    err = (out.float() - expect).abs().max().item()
    assert err < 1e-2 * max(1.0, expect.abs().max().item()), f"max error {err}"


def _worker(rank: int, world: int, port: int, order: str, result_path: str) -> None:
    os.environ.update(ENV)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    import ep_backend  # noqa: F401  registers "ep"

    dist.init_process_group("ep", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    results: list[tuple[str, str]] = []

    def step(name: str, fn) -> bool:
        try:
            fn()
            results.append((name, "ok"))
            return True
        except Exception as exc:  # the trial reports every step
            results.append((name, f"ERROR {type(exc).__name__}: {exc}"))
            traceback.print_exc()
            return False

    steps = (
        [("n4p init (uid via c10d store)", lambda: _n4p_init(rank, world, store)),
         ("n4p symmetric tensor, peer write", lambda: _n4p_tensor_check(rank, world)),
         ("ep low-latency ops after n4p", lambda: _ep_low_latency_check(rank, world))]
        if order == "n4p-first"
        else [("ep low-latency ops", lambda: _ep_low_latency_check(rank, world)),
              ("n4p init after ep (uid via c10d store)", lambda: _n4p_init(rank, world, store)),
              ("n4p symmetric tensor, peer write", lambda: _n4p_tensor_check(rank, world)),
              ("ep low-latency ops again", lambda: _ep_low_latency_check(rank, world))]
    )  # fmt: skip
    for name, fn in steps:
        if not step(name, fn):
            break  # later steps depend on this one
    results.append(("libs", "; ".join(_mapped_nvshmem_libs()) or "none mapped"))
    with open(f"{result_path}.{rank}", "w") as f:
        for name, status in results:
            f.write(f"{name}\t{status}\n")
    os._exit(0)  # skip teardown: a half-initialised NVSHMEM may hang in finalize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--order", choices=["ep-first", "n4p-first"], default="n4p-first")
    ap.add_argument("--world", type=int, default=min(2, torch.cuda.device_count()))
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"/tmp/n4p_trial_{os.getpid()}"
    mp.start_processes(_worker, args=(args.world, port, args.order, path), nprocs=args.world,
                       start_method="spawn", join=True)  # fmt: skip
    passed = failed = 0
    for r in range(args.world):
        try:
            lines = open(f"{path}.{r}").read().splitlines()
        except OSError:
            print(f"CHECK rank {r}: no result (process died)")
            failed += 1
            continue
        for line in lines:
            name, status = line.split("\t", 1)
            if name == "libs":
                print(f"rank {r} libnvshmem_host mapped: {status}")
                continue
            print(f"CHECK rank {r} {name}: {status}")
            passed += status == "ok"
            failed += status != "ok"
    print(f"TRIAL {args.order}: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
