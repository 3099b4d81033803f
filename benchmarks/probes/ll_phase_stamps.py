"""Phase stamps of the low-latency kernels at one rank: where an FP8 dispatch and a combine spend
their microseconds when no link is involved.

    python benchmarks/probes/ll_phase_stamps_patch.py DIR   # DIR: a copy of the tree, patched
    (cd DIR && EP_WITH_CUDA=1 EP_BUILD_DIR=$PWD/.build pip install --no-build-isolation -e .)
    python benchmarks/probes/ll_phase_stamps.py             # with that build installed

The patcher adds %globaltimer stamps per block and phase to the copy's NVSHMEM dispatch and combine
kernels (a diagnostic build: never the product's kernels) and a C entry `ep_probe_dump` in
libep_nvshmem.so; this script makes a group of one rank on GPU 0, warms up, then prints, for three
FP8 dispatch + combine pairs (each kernel alone on an idle GPU) and one queued pair, each stamp's
min / median / max over the blocks, in µs from the first block's start.

Dispatch stamps: 0 start; 1 step 1 done (payload stored); 2 counts sent; 3 send warps done
(headers and flags released); 4 receive warps saw every count; 5 per-expert outputs written;
6 receive warps done (thread 512). Stamp 7 (after the final barrier) reads early: the compiler
hoists the timer read above the barrier. Combine stamps: 0 start; 1 weights sent; 2 a block's
first release of pending partials; 3 send phase done; 6 receive phase done; 7 end.
"""

from __future__ import annotations


def run() -> None:
    import ctypes
    import os
    import pathlib

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29598")
    torch.cuda.set_device(0)
    import ep_backend as ep

    dist.init_process_group("ep", rank=0, world_size=1)
    lib = ctypes.CDLL(str(pathlib.Path(ep.__file__).parent / "libep_nvshmem.so"))
    if not hasattr(lib, "ep_probe_dump"):
        raise SystemExit("libep_nvshmem.so has no ep_probe_dump: build a copy patched by `patch`")
    g = torch.Generator(device="cuda").manual_seed(0)
    m, e, t, h = 256, 8, 128, 7168
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w, idx = torch.rand(t, e, device="cuda", generator=g).topk(8, dim=1)
    y = ep.low_latency_dispatch(x, idx, m, e, use_fp8=False).recv_x
    for _ in range(20):
        d = ep.low_latency_dispatch(x, idx, m, e, use_fp8=True)
        ep.low_latency_combine(y, idx, w, d.handle)
    torch.cuda.synchronize()
    print("transport", ep.get_backend().low_latency_transport, flush=True)
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(3):  # each kernel alone on an idle GPU
        d = ep.low_latency_dispatch(x, idx, m, e, use_fp8=True)
        torch.cuda.synchronize()
        lib.ep_probe_dump(0, blocks)
        ep.low_latency_combine(y, idx, w, d.handle)
        torch.cuda.synchronize()
        lib.ep_probe_dump(1, blocks)
    d = ep.low_latency_dispatch(x, idx, m, e, use_fp8=True)  # the combine queued behind it
    ep.low_latency_combine(y, idx, w, d.handle)
    torch.cuda.synchronize()
    print("queued pair:", flush=True)
    lib.ep_probe_dump(0, blocks)
    lib.ep_probe_dump(1, blocks)
    dist.destroy_process_group()


if __name__ == "__main__":
    run()
