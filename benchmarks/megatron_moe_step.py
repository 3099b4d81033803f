"""Megatron-Core's MoE layer step (forward + backward), flex dispatcher on ``ep`` (``deepep``
backend through the ``deep_ep`` facade) vs the alltoall dispatcher on NCCL, in the same run.

    python benchmarks/megatron_moe_step.py [--tokens 4096] [--hidden 2048] [--steps 30]

One process per GPU (all visible GPUs, at least 2), BF16, local ``SequentialMLP`` experts (no
Transformer Engine), the same weights and inputs for both dispatchers. Prints one row per
dispatcher: the median time per step on rank 0 (CUDA events around each step, after warm-up;
each step starts after a barrier and a device sync, so its host work is not hidden), the time
per step of a loop of the same steps with one sync at the end (what training sees), and the
ratios. ``--profile N`` adds torch.profiler tables of N steps per dispatcher (by CPU and by CUDA
time) to find where the time goes. Prints a skip line and exits 0 where megatron-core or two GPUs are missing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(_TESTS))  # megatron_cases: the layer set-up the tests compare

import megatron_cases  # noqa: E402


def _step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """One forward + backward of ``layer`` on ``x`` (queued; no sync)."""
    inp = x.detach().requires_grad_(True)
    out, _ = layer(inp)
    out.float().square().mean().backward()


def _step_times(layer: torch.nn.Module, x: torch.Tensor, steps: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``steps`` forward+backward steps of ``layer`` on ``x``."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(layer, x)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def _loop_time(layer: torch.nn.Module, x: torch.Tensor, steps: int) -> float:
    """Milliseconds per step of ``steps`` forward+backward steps issued back to back with one sync
    at the end: what a training loop sees when its host runs ahead of the GPU."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        _step(layer, x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def _profile(layer: torch.nn.Module, x: torch.Tensor, steps: int, name: str, rank: int) -> None:
    """``steps`` steps under torch.profiler; rank 0 prints the ops by CPU time (where the host's
    time goes) and by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(layer, x)
        torch.cuda.synchronize()
    if rank == 0:
        table = prof.key_averages()
        print(f"== profile: {name}, {steps} steps, by self CPU time")
        print(table.table(sort_by="self_cpu_time_total", row_limit=25))
        print(f"== profile: {name}, {steps} steps, by CUDA time")
        print(table.table(sort_by="device_time_total", row_limit=15))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):  # fmt: skip
        os.environ.setdefault(key, value)
    torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world, timeout=timeout
    )
    import ep_backend  # noqa: F401  registers "ep"

    megatron_cases.import_megatron()
    device = torch.device("cuda", rank)
    shape = megatron_cases.MoeShape(
        hidden=args.hidden, ffn_hidden=args.ffn_hidden, experts_per_rank=args.experts_per_rank,
        topk=args.topk, seq=args.tokens, batch=1,
    )  # fmt: skip
    flex = megatron_cases.build_moe_layer("flex", "ep", shape, torch.bfloat16, device)
    alltoall = megatron_cases.build_moe_layer("alltoall", "nccl", shape, torch.bfloat16, device)
    alltoall.load_state_dict(flex.state_dict())
    x = megatron_cases.layer_inputs(rank, shape, torch.bfloat16, device)
    rows, loops = {}, {}
    for name, layer in (("flex on ep", flex), ("alltoall on nccl", alltoall)):
        rows[name] = statistics.median(_step_times(layer, x, args.steps, args.warmup))
        loops[name] = _loop_time(layer, x, args.steps)
    if args.profile:
        for name, layer in (("flex on ep", flex), ("alltoall on nccl", alltoall)):
            _profile(layer, x, args.profile, name, rank)
    if rank == 0:
        print(f"Megatron MoE layer step (fwd+bwd), {world} GPUs, {args.tokens} tokens/rank, "
              f"H={args.hidden}, FFN={args.ffn_hidden}, {args.experts_per_rank * world} experts, "
              f"top-{args.topk}, BF16, median of {args.steps}:")  # fmt: skip
        for name, ms in rows.items():
            print(f"  {name:<18} {ms:8.3f} ms/step (synced), {loops[name]:8.3f} ms/step (loop)")
        ratio = rows["alltoall on nccl"] / rows["flex on ep"]
        loop_ratio = loops["alltoall on nccl"] / loops["flex on ep"]
        print(f"  flex-on-ep speed-up over alltoall-on-nccl: {ratio:.2f}x synced, "
              f"{loop_ratio:.2f}x in a loop")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn-hidden", type=int, default=1408)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N steps per dispatcher (torch.profiler tables)")  # fmt: skip
    args = parser.parse_args()
    if not megatron_cases.megatron_installed():
        print(f"megatron_moe_step: skipped: {megatron_cases.MEGATRON_SKIP_REASON}")
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"megatron_moe_step: skipped: needs 2 CUDA GPUs, found {gpus}")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(gpus, port, args), nprocs=gpus)


if __name__ == "__main__":
    main()
