"""Is a queued dispatch row host-bound? (2 ranks, one GPU each.)

Times dispatch as the bench's "queued" rows do (host barrier, 1 ms of queued GPU sleep, L2 flush,
a one-element all-reduce, then start event, the call, end event), once through ``ep.dispatch``
and once through the raw custom op (no Python wrapper work after the host's count wait). When
the end event's time depends on which one is called, the host's work after the count wait, not
the GPU, ends the op's span (EP_DEBUG_AFTER_COUNT_WAIT_US adds host time there, to find the
slack). Usage: python scripts/queued_probe.py [T]
"""

import statistics
import sys
import time

import local_ranks
import torch
import torch.distributed as dist


def worker(rank: int, tokens: int, port: int) -> None:
    import ep_backend as ep
    from ep_backend import moe

    local_ranks.join_group(rank, 2, port)
    x, idx, w = local_ranks.standard_inputs(tokens, rank)
    x8, s8 = ep.reference.quantize_fp8_per128(x)
    lead = local_ranks.QueuedLead()
    group = dist.group.WORLD.group_name

    def raw(xx, ss):
        return moe._ops.dispatch(xx, ss, idx, w, 256, 1, 0, group, [])

    layout = ep.get_dispatch_layout(idx, 256)
    calls = {
        "wrapper FP8, layout given": lambda: ep.dispatch(
            x8, idx, w, 256, x_scales=s8, layout=layout
        ),
        "wrapper BF16, layout given": lambda: ep.dispatch(x, idx, w, 256, layout=layout),
        "wrapper BF16": lambda: ep.dispatch(x, idx, w, 256),
        "raw op  BF16": lambda: raw(x, None),
        "wrapper FP8": lambda: ep.dispatch(x8, idx, w, 256, x_scales=s8),
        "raw op  FP8": lambda: raw(x8, s8),
    }
    for fn in calls.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for _ in range(2):
        for name, fn in calls.items():
            gpu, host = [], []
            for _ in range(20):
                start = lead.start()
                end = torch.cuda.Event(enable_timing=True)
                h0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - h0) * 1e6)
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end) * 1e3)
            med = torch.tensor(
                [statistics.median(gpu), statistics.median(host)], dtype=torch.float64
            )
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"{name}: queued {med[0]:.1f} us (host in call {med[1]:.0f} us)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    local_ranks.spawn(worker, (int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 29581))
