"""What the GPU profiling scripts share: one process per GPU in an "ep" group, standard inputs.

Used as `import local_ranks` by scripts run as `python benchmarks/<name>.py` (benchmarks/ is then on
sys.path).
"""

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Never NVLink multicast on the GPU machines (design.md).
_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def spawn(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2) -> None:
    """Runs ``worker(rank, *args)`` in ``nprocs`` processes, with the multicast switches off."""
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
    mp.spawn(worker, args=args, nprocs=nprocs)


def join_group(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """Binds this rank to GPU ``rank % device_count`` and joins the WORLD "ep" group."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("ep", store=store, rank=rank, world_size=world, timeout=timeout)


def standard_inputs(
    tokens: int, rank: int, hidden: int = 7168, experts: int = 256, topk: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bench's HT shape on this GPU: x BF16 [T, H], topk_idx int64 [T, K] (top-K of random
    scores, distinct experts) and their float32 weights [T, K], seeded by ``rank``."""
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    weights, idx = torch.rand(tokens, experts, device="cuda", generator=g).topk(topk, dim=1)
    return x, idx, weights


class QueuedLead:
    """What the bench's "queued" rows put ahead of an op: a host barrier, ~1 ms of GPU sleep, an
    L2 flush and a one-element all-reduce that puts the GPUs in step. ``start()`` queues all that
    and returns the start event (recorded), so the op is issued while the GPU is still busy."""

    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.token = torch.zeros(1, device="cuda")

    def start(self) -> torch.cuda.Event:
        dist.barrier()
        torch.cuda._sleep(2_000_000)
        self.flush.zero_()
        dist.all_reduce(self.token)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
