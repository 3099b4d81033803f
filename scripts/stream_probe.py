"""Do the HT ops take longer on PyTorch's default (legacy NULL) stream than on a created one?

Usage: python scripts/stream_probe.py [ranks] [rounds]   (default: one rank per GPU, 3 rounds)

Times the bench's queued rows (``ep_backend.bench._Timer.both``: ~1 ms of GPU work queued ahead,
L2 flush, GPUs in step, then the op between two events) for FP8 and BF16 dispatch with the layout
given, combine and cached dispatch, once on the current stream as a script leaves it (the legacy
default stream) and once inside ``torch.cuda.stream(side)``, the two alternating over rounds.
The kernels are the same; a difference is what the stream costs (for instance a launch attribute
the legacy stream does not honour). With fewer GPUs than ranks the ranks share a GPU (then the
numbers say nothing about NVLink; one rank is enough for this question).
"""

import statistics
import sys

import local_ranks
import torch
import torch.distributed as dist


def worker(rank: int, world: int, rounds: int, port: int) -> None:
    import ep_backend as ep
    from ep_backend.bench import _Timer

    local_ranks.join_group(rank, world, port)
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = local_ranks.standard_inputs(4096, rank)
    num_experts = 256
    x8, s8 = ep.reference.quantize_fp8_per128(x)
    layout = ep.get_dispatch_layout(idx, num_experts)
    token = torch.zeros(1, device=device)
    shared = world > torch.cuda.device_count()
    timer = _Timer(device, 30, 5, None if shared else (lambda: dist.all_reduce(token)))
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):  # outputs made on each stream for the combine / cached rows
        side_out = ep.dispatch(x, idx, w, num_experts)
    main_out = ep.dispatch(x, idx, w, num_experts)

    def ops(out) -> dict:
        return {
            "dispatch FP8, layout given": lambda: ep.dispatch(
                x8, idx, w, num_experts, x_scales=s8, layout=layout
            ),
            "dispatch BF16, layout given": lambda: ep.dispatch(
                x, idx, w, num_experts, layout=layout
            ),
            "combine BF16": lambda: ep.combine(out.recv_x, out.handle),
            "cached dispatch BF16": lambda: ep.dispatch(x, handle=out.handle),
        }

    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for where in ("default stream", "side stream"):
            if where == "side stream":
                with torch.cuda.stream(side):
                    for name, fn in ops(side_out).items():
                        results.setdefault((name, where), []).append(timer.both(fn)[0])
            else:
                for name, fn in ops(main_out).items():
                    results.setdefault((name, where), []).append(timer.both(fn)[0])
    torch.cuda.synchronize()
    if rank == 0:
        print(
            f"ranks {world}, GPUs {torch.cuda.device_count()}, queued us (max over ranks) per round"
        )
        for (name, where), v in results.items():
            print(f"  {name:30s} {where:15s} median {statistics.median(v):7.1f}  rounds "
                  + " ".join(f"{t:.1f}" for t in v))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else max(1, torch.cuda.device_count())
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    from ep_backend.bench import _free_port

    local_ranks.spawn(worker, (world, rounds, _free_port()), nprocs=world)
