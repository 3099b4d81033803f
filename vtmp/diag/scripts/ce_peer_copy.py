"""Copy-engine throughput between GPU 0 and GPU 1 (cudaMemcpyPeerAsync through torch), one
direction and both at once; a lead for dispatch/combine designs that move rows without SMs.

Usage: python scripts/ce_peer_copy.py [MiB] [reps]
"""

from __future__ import annotations

import statistics
import sys

import torch


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    n = mib << 20
    a = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    b = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]

    def run(directions: list[int]) -> float:
        times = []
        for _ in range(reps + 3):
            for d in (0, 1):
                torch.cuda.synchronize(d)
            ev = {}
            for d in directions:  # copy a[d] (on GPU d) into b[1-d] (on the peer), issued on d
                with torch.cuda.stream(streams[d]):
                    s, e = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    s.record()
                    b[1 - d].copy_(a[d], non_blocking=True)
                    e.record()
                    ev[d] = (s, e)
            for d in directions:
                ev[d][1].synchronize()
            times.append(max(s.elapsed_time(e) for s, e in ev.values()) * 1e3)
        return statistics.median(times[3:])

    for name, dirs in (("0->1", [0]), ("1->0", [1]), ("both at once", [0, 1])):
        us = run(dirs)
        print(f"CE {name:13s} {mib} MiB: {us:8.1f} us  {n / us / 1e3:6.1f} GB/s per direction")
    pitched(reps)


def pitched(reps: int, rows: int = 4096, width: int = 14336, pitch: int = 14464) -> None:
    """cudaMemcpy2DAsync into rows of a wider pitch (the dispatch buffer's row layout), both
    directions at once, in 1 or more chunks issued back to back on one stream per GPU."""
    import ctypes
    import glob
    import os

    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**",
                                  "libcudart.so*"), recursive=True)  # fmt: skip
    cudart = ctypes.CDLL(libs[0] if libs else "libcudart.so")
    src = [torch.empty(rows * width, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    dst = [torch.empty(rows * pitch, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
    side = [[torch.cuda.Stream(device=d) for _ in range(2)] for d in (0, 1)]
    for d in (0, 1):  # peer access for the raw copies
        with torch.cuda.device(d):
            cudart.cudaDeviceEnablePeerAccess(1 - d, 0)
    cases = ((1, width, 1), (1, pitch, 1), (8, pitch, 1), (32, pitch, 1), (4, pitch, 2),
             (8, pitch, 2), (16, pitch, 2))  # fmt: skip
    for chunks, dpitch, nstreams in cases:
        times = []
        for _ in range(reps + 3):
            for d in (0, 1):
                torch.cuda.synchronize(d)
            ev = {}
            for d in (0, 1):
                with torch.cuda.device(d):
                    main = torch.cuda.current_stream(d)
                    s, e = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    s.record(main)
                    for st in side[d][:nstreams]:
                        st.wait_event(s)
                    per = (rows + chunks - 1) // chunks
                    for i, r0 in enumerate(range(0, rows, per)):
                        n = min(per, rows - r0)
                        err = cudart.cudaMemcpy2DAsync(
                            ctypes.c_void_p(dst[1 - d].data_ptr() + r0 * dpitch),
                            ctypes.c_size_t(dpitch),
                            ctypes.c_void_p(src[d].data_ptr() + r0 * width),
                            ctypes.c_size_t(width), ctypes.c_size_t(width), ctypes.c_size_t(n),
                            ctypes.c_int(3),
                            ctypes.c_void_p(side[d][i % nstreams].cuda_stream))  # fmt: skip
                        assert err == 0, err
                    for st in side[d][:nstreams]:
                        main.wait_stream(st)
                    e.record(main)
                    ev[d] = (s, e)
            for d in (0, 1):
                ev[d][1].synchronize()
            times.append(max(s.elapsed_time(e) for s, e in ev.values()) * 1e3)
        us = statistics.median(times[3:])
        print(f"CE 2D both ways, {rows} rows x {width} B, pitch {dpitch}, {chunks:2d} chunk(s), "
              f"{nstreams} stream(s): "
              f"{us:8.1f} us  {rows * width / us / 1e3:6.1f} GB/s per direction")  # fmt: skip


if __name__ == "__main__":
    main()
