"""The internode transport on emulated nodes: dispatch (BF16, FP8) and combine times with the bytes
of each leg (RDMA: between nodes; NVLink: inside a node), one process per GPU.

Usage: python benchmarks/internode_emulated.py WORLD RANKS_PER_NODE [T] [iters] [--profile]
       (e.g. 2 1 for 2 nodes x 1 GPU, 4 2 for 2 x 2; T defaults to 4096, H=7168, top-8 of 256,
       Options.num_sms = 24, the bench's shape). --profile: rank 0 also prints the GPU time of
       each kernel of a BF16 dispatch and combine (torch.profiler, 3 calls each).

Times are medians over `iters` (max over ranks) of the op alone, after a barrier; the legs' bytes
are what this rank's tokens put on each leg (summed over ranks: the traffic of the whole group),
counted from the routing with the kernels' record sizes: dispatch RDMA = one record per (token,
remote node it visits), NVLink = one output record per (token, destination rank) whose forwarder
is another GPU; combine RDMA = one float32 partial row per (token, remote node), NVLink = one row
per received row whose forwarder is another GPU. On one host the "RDMA" leg runs over NVLink
through NVSHMEM's put path: the times are protocol costs, not predictions for a NIC
(docs/internode.md). Each dispatch is also timed with num_worst_tokens (no host wait for the
counts: what a CUDA graph replays).
"""

import os
import statistics
import sys

import local_ranks
import torch
import torch.distributed as dist

H, E, K = 7168, 256, 8


def _align16(v: int) -> int:
    return (v + 15) // 16 * 16


def _legs(in_rank: torch.Tensor, nodes: list[int], local: list[int], me: int,
          recv_from: list[int], x_bytes: int, s_bytes: int) -> dict[str, int]:  # fmt: skip
    """Bytes this rank puts on each leg (see the module docstring)."""
    world = len(nodes)
    per_node = world // (max(nodes) + 1)
    in_rank = in_rank.cpu()
    rdma_rows = 0
    nvl_rows = 0
    for n in sorted(set(nodes)):
        ranks = [r for r in range(world) if nodes[r] == n]
        visits = in_rank[:, ranks].any(1)
        if n != nodes[me]:
            rdma_rows += int(visits.sum())
        forwarder = ranks[local[me]]
        nvl_rows += int(in_rank[:, [r for r in ranks if r != forwarder]].sum())
    record = 16 + _align16(4 * per_node) + _align16(x_bytes) + _align16(s_bytes)
    record += _align16(8 * K) + _align16(4 * K)
    out_record = _align16(x_bytes) + _align16(s_bytes) + _align16(8 * K) + _align16(4 * K) + 16
    comb_nvl_rows = sum(c for s, c in enumerate(recv_from) if local[s] != local[me])
    return {
        "dispatch_rdma_rows": rdma_rows,
        "dispatch_rdma_bytes": rdma_rows * record,
        "dispatch_nvlink_rows": nvl_rows,
        "dispatch_nvlink_bytes": nvl_rows * out_record,
        "combine_nvlink_bytes": comb_nvl_rows * (_align16(2 * H) + _align16(4 * K)),
        "combine_rdma_bytes": rdma_rows * (_align16(4 * H) + 4 * K),
    }


def _time(fn, iters: int) -> float:  # noqa: ANN001
    samples = []
    for i in range(iters + 3):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def _profile(rank: int, fn, label: str) -> None:  # noqa: ANN001
    """Rank 0 prints the GPU time per call of each kernel of ``fn`` (3 calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    if rank != 0:
        return
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((us / 3, e.key))
    for us, key in sorted(rows, reverse=True)[:12]:
        # The end of the name: ep's kernels are in an anonymous namespace (a long prefix).
        print(f"  profile {label}: {us:9.1f} us/call  ...{key[-70:]}", flush=True)


def worker(rank: int, world: int, per_node: int, tokens: int, iters: int, port: int,
           profiled: bool) -> None:  # fmt: skip
    import ep_backend as ep
    from ep_backend import reference as ref

    local_ranks.join_group(rank, world, port, timeout_s=300.0)
    topo = ep.topology()
    x, idx, w = local_ranks.standard_inputs(tokens, rank, H, E, K)
    x8, s8 = ref.quantize_fp8_per128(x.float())
    results = {}
    for tag, xin, scales in (("BF16", x, None), ("FP8", x8, s8)):
        out = ep.dispatch(xin, idx, w, E, x_scales=scales)
        t_dispatch = _time(
            lambda xin=xin, scales=scales: ep.dispatch(xin, idx, w, E, x_scales=scales), iters
        )
        recv_from = out.handle.num_recv_tokens_per_rank.tolist()
        legs = _legs(out.handle.is_token_in_rank, list(topo.node_of_rank), list(topo.local_rank),
                     rank, recv_from, xin.shape[1] * xin.element_size(),
                     0 if scales is None else scales.shape[1] * 4)  # fmt: skip
        # Combine always sums BF16 rows (the experts' outputs).
        y = (
            out.recv_x
            if tag == "BF16"
            else torch.randn(out.recv_x.shape, device=x.device).bfloat16()
        )
        t_combine = _time(lambda y=y, out=out: ep.combine(y, out.handle), iters)
        worst = tokens * world
        t_worst = _time(
            lambda xin=xin, scales=scales, worst=worst: ep.dispatch(
                xin, idx, w, E, x_scales=scales, num_worst_tokens=worst
            ),
            iters,
        )
        if profiled and tag == "BF16":
            _profile(rank, lambda xin=xin: ep.dispatch(xin, idx, w, E), "dispatch")
            _profile(rank, lambda y=y, out=out: ep.combine(y, out.handle), "combine")
        vals = torch.tensor([t_dispatch, t_combine, t_worst], dtype=torch.float64, device=x.device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        sums = torch.tensor(list(legs.values()), dtype=torch.float64, device=x.device)
        dist.all_reduce(sums)
        results[tag] = (vals.tolist(), dict(zip(legs, sums.tolist(), strict=True)))
    transport = ep.get_backend().high_throughput_transport
    if rank == 0:
        for tag, ((td, tc, tw), legs) in results.items():
            mb = {k: v / 1e6 / world for k, v in legs.items() if k.endswith("bytes")}
            print(f"internode {world // per_node}x{per_node} ({transport}) {tag} T={tokens} H={H} "
                  f"top-{K}/{E} 24 SMs: dispatch {td:8.1f} us (num_worst_tokens {tw:8.1f}), "
                  f"combine {tc:8.1f} us | per GPU: "
                  f"dispatch RDMA {mb['dispatch_rdma_bytes']:.1f} MB "
                  f"({legs['dispatch_rdma_rows'] / world:.0f} rows), NVLink "
                  f"{mb['dispatch_nvlink_bytes']:.1f} MB "
                  f"({legs['dispatch_nvlink_rows'] / world:.0f} rows); combine RDMA "
                  f"{mb['combine_rdma_bytes']:.1f} MB, NVLink {mb['combine_nvlink_bytes']:.1f} MB",
                  flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    world, per_node = int(sys.argv[1]), int(sys.argv[2])
    numbers = [a for a in sys.argv[3:] if not a.startswith("--")]
    tokens = int(numbers[0]) if numbers else 4096
    iters = int(numbers[1]) if len(numbers) > 1 else 20
    os.environ["EP_RANKS_PER_NODE"] = str(per_node)
    profiled = "--profile" in sys.argv
    local_ranks.spawn(
        worker, (world, per_node, tokens, iters, 29500 + os.getpid() % 1000, profiled), world
    )
