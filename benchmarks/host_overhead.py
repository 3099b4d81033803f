"""Host time of one MoE op call, split into the Python layer and the custom op beneath it.

One rank, one GPU (the op's host path is the same at any rank count up to the exchange):
    python benchmarks/host_overhead.py [--iters N] [--rounds R]
Prints, per row, the min and the median over R rounds of each round's median (µs): ep.dispatch /
ep.combine as users call them, the registered custom op called through ``torch.ops`` and through
the typed dispatcher (``_C._call_combine``, what the Python layer calls on a plain eager call),
and a one-element torch op (this host's floor). Rows take turns within each round: the
host's speed drifts by tens of percent over a run on the GPU VMs, so rows timed one after the
other are not comparable.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def median_host_us(fn, iters: int) -> float:
    from ep_backend.bench import host_us_per_call  # after the worker's set_device

    return host_us_per_call(fn, iters, skip=iters // 5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=60, help="timed calls per row and round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    import ep_backend as ep
    from ep_backend import reference as ref

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("ep", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    pg = dist.group.WORLD
    T, H, E, K = 4096, 7168, 256, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda", generator=g)
    x8, s8 = ref.quantize_fp8_per128(x)
    lay = ep.get_dispatch_layout(idx, E)
    lt = ep.moe._check_layout(lay, idx, E, pg.size())
    name = pg.group_name
    out = ep.dispatch(x, idx, w, E, layout=lay)
    routing = ep.moe._routing(out.handle)
    native = ep._C
    rows = {
        "one-element torch op": lambda: x.new_ones(1),
        "ep.dispatch FP8, layout given": lambda: ep.dispatch(
            x8, idx, w, E, x_scales=s8, layout=lay
        ),
        "torch.ops.ep.dispatch (same)": lambda: torch.ops.ep.dispatch(
            x8, s8, idx, w, E, 1, 0, name, lt
        ),
        "torch.ops.ep.dispatch.default": lambda: torch.ops.ep.dispatch.default(
            x8, s8, idx, w, E, 1, 0, name, lt
        ),
        "ep.combine BF16": lambda: ep.combine(out.recv_x, out.handle),
        "torch.ops.ep.combine.default": lambda: torch.ops.ep.combine.default(
            out.recv_x, None, None, None, *routing, name
        ),
        "_C._call_combine (typed dispatcher)": lambda: native._call_combine(
            out.recv_x, None, None, None, *routing, name
        ),
    }
    samples: dict[str, list[float]] = {label: [] for label in rows}
    for _ in range(args.rounds):
        for label, fn in rows.items():
            median_host_us(fn, 10)  # warm-up
            samples[label].append(median_host_us(fn, args.iters))
    for label, values in samples.items():
        print(f"{label:34s} min {min(values):7.1f}  median {statistics.median(values):7.1f} "
              "µs host", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
