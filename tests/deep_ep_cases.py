"""Code written for DeepEP V1's ``deep_ep.Buffer``, checked against ``ep_backend.reference``.

Each ``case_*`` function is what a DeepEP user writes (``import deep_ep``; ``Buffer``;
``get_dispatch_layout``; ``dispatch``; ``combine``; the low-latency calls), run on one rank of
a group after ``ep_backend.deep_ep.install()``, and compares the results with the executable
spec on the facade's ``"ep"`` group: bitwise where the op is a copy (layout, dispatch, cached
dispatch, low-latency dispatch) and for the combines (the reference's reduction order is ep's).
The same cases run on CPU ranks (tests/test_deep_ep_cpu.py) and on GPUs
(tests/test_deep_ep_gpu.py). A failed check raises ``AssertionError`` naming the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_backend import reference as ref
from ep_backend.deep_ep import logfmt

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bytes (NaN-safe)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True


def check(ok: bool, rank: int, what: str) -> None:
    if not ok:
        raise AssertionError(f"rank {rank}: {what}")


def routing(
    rank: int,
    world: int,
    seed: int,
    device: torch.device,
    num_tokens: int | None = None,
    hidden: int = 256,
    topk: int = 4,
    experts_per_rank: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``x`` BF16 ``[T, H]``, ``topk_idx`` int64 ``[T, K]`` (distinct, 10% -1), weights, ``E``."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    num_experts = experts_per_rank * world
    if num_tokens is None:
        num_tokens = int(torch.randint(0, 13, (1,), generator=g))
    x = torch.randn(num_tokens, hidden, generator=g).to(BF16)
    idx = torch.rand(num_tokens, num_experts, generator=g).topk(min(topk, num_experts)).indices
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    w = torch.rand(idx.shape, generator=g)
    return x.to(device), idx.to(device), w.to(device), num_experts


def _fp8_with_deepep_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test input: FP8 rows and float32 ``[T, H/128]`` scales, column-major."""
    x_fp8, scales = ref.quantize_fp8_per128(x)
    return x_fp8, scales.T.contiguous().T


def case_normal(rank: int, world: int, device: torch.device, seed: int) -> None:
    """Layout, dispatch (BF16, FP8 tuple, alignment, worst tokens, no topk_idx), combine with
    bias, cached dispatch and the stream flags, as DeepEP's tests and callers use them."""
    import deep_ep

    buffer = deep_ep.Buffer(dist.group.WORLD, int(1e8), 0)
    check(buffer.group_size == world and buffer.rank == rank, rank, "rank/group_size")
    group = buffer.ep_group
    check(deep_ep.Buffer(dist.group.WORLD).ep_group is group, rank, "ep group not cached")
    x, topk_idx, topk_weights, num_experts = routing(rank, world, seed, device)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    (per_rank, per_rdma_rank, per_expert, in_rank, event) = layout
    want = ref.get_dispatch_layout(topk_idx, num_experts, world)
    check(same_bytes(per_rank, want.num_tokens_per_rank), rank, "num_tokens_per_rank")
    check(same_bytes(per_expert, want.num_tokens_per_expert), rank, "num_tokens_per_expert")
    check(same_bytes(in_rank, want.is_token_in_rank), rank, "is_token_in_rank")
    check(per_rdma_rank is None and isinstance(event, deep_ep.EventOverlap), rank, "layout extras")

    for fp8, alignment, worst in ((False, 1, 0), (True, 4, 0), (False, 1, 64)):
        data = _fp8_with_deepep_scales(x) if fp8 else x
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            data, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
            topk_weights=topk_weights, expert_alignment=alignment, num_worst_tokens=worst,
        )  # fmt: skip
        x_in, scales_in = data if fp8 else (data, None)
        want = ref.dispatch(
            x_in, topk_idx, topk_weights, num_experts, x_scales=scales_in,
            expert_alignment=alignment, num_worst_tokens=worst, group=group,
        )  # fmt: skip
        got_x, got_scales = recv_x if fp8 else (recv_x, None)
        n = int(want.handle.num_recv_tokens_per_rank.sum())
        tag = f"dispatch fp8={fp8} alignment={alignment} worst={worst}"
        check(same_bytes(got_x[:n], want.recv_x[:n]), rank, f"{tag}: recv_x")
        check(same_bytes(got_scales if got_scales is None else got_scales[:n],
                         None if want.recv_x_scales is None else want.recv_x_scales[:n]),
              rank, f"{tag}: scales")  # fmt: skip
        check(same_bytes(recv_idx, want.recv_topk_idx), rank, f"{tag}: recv_topk_idx")
        check(same_bytes(recv_w, want.recv_topk_weights), rank, f"{tag}: recv_topk_weights")
        check(counts == want.num_recv_tokens_per_expert_list, rank, f"{tag}: per-expert list")
        check(len(handle) == 6, rank, "handle has DeepEP's 6 fields")
        prefix = handle[0]
        ends = torch.cumsum(want.handle.num_recv_tokens_per_rank.cpu(), 0)
        check(torch.equal(prefix[:, rank].cpu(), ends.to(torch.int32)), rank, f"{tag}: handle[0]")
        check(same_bytes(handle[3], want.handle.recv_src_idx), rank, f"{tag}: handle[3]")
        check(handle[4] is in_rank or torch.equal(handle[4], in_rank), rank, f"{tag}: handle[4]")
        send_head = handle[5]
        check(bool(((send_head >= 0) == in_rank).all()), rank, f"{tag}: handle[5]")

        if not fp8:
            y = got_x.float().mul(rank + 1).to(BF16)
            bias = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).to(BF16)
            bias = bias.to(device)
            combined, combined_w, event = buffer.combine(y, handle, topk_weights=recv_w, bias=bias)
            want_c = ref.combine(y, want.handle, recv_w, bias, group=group)
            check(same_bytes(combined, want_c.combined_x), rank, f"{tag}: combine")
            check(same_bytes(combined_w, want_c.combined_topk_weights), rank, f"{tag}: weights")
            check(torch.equal(combined_w.cpu(), (topk_weights * (topk_idx >= 0)).cpu()), rank,
                  f"{tag}: combined weights rebuild the routing weights")  # fmt: skip

            # Cached dispatch (the backward of combine), with DeepEP's async flags.
            x2 = (x.float() * 3).to(BF16)
            previous = deep_ep.EventOverlap(deep_ep.utils.EventHandle())
            got = buffer.dispatch(x2, handle=handle, previous_event=previous,
                                  async_finish=True, allocate_on_comm_stream=True)  # fmt: skip
            check(got[1:5] == (None, None, None, None), rank, "cached dispatch tuple")
            got[5].current_stream_wait()
            want2 = ref.dispatch(x2, topk_idx, topk_weights, num_experts,
                                 num_worst_tokens=worst, group=group)  # fmt: skip
            check(same_bytes(got[0][:n], want2.recv_x[:n]), rank, f"{tag}: cached dispatch")

    # Routing by is_token_in_rank alone.
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank
    )
    want = ref.dispatch(x, topk_idx, topk_weights, num_experts, group=group)
    check(same_bytes(recv_x, want.recv_x), rank, "dispatch without topk_idx: recv_x")
    check(recv_idx is None and recv_w is None and counts == [], rank, "without topk_idx: outputs")
    combined, none_w, _ = buffer.combine(recv_x, handle)
    check(same_bytes(combined, ref.combine(want.recv_x, want.handle, group=group).combined_x),
          rank, "combine after dispatch without topk_idx")  # fmt: skip
    check(none_w is None, rank, "combine without weights")

    # Megatron's sequence: layout and dispatch with async_finish and a captured event.
    previous = deep_ep.Buffer.capture()
    per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
        topk_idx, num_experts, previous_event=previous, async_finish=True,
        allocate_on_comm_stream=True,
    )  # fmt: skip
    out = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                          num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                          is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          previous_event=event, async_finish=True, allocate_on_comm_stream=True)  # fmt: skip
    out[5].current_stream_wait()
    with out[5]:
        pass
    check(same_bytes(out[0], want.recv_x), rank, "async dispatch")


def case_low_latency(rank: int, world: int, device: torch.device, seed: int) -> None:
    """Low-latency dispatch (BF16, FP8, UE8M0, hook, stats) and combine (plain, out=,
    zero-copy, LogFMT) against the reference."""
    import deep_ep

    max_tokens, hidden = 16, 512
    x, topk_idx, topk_weights, num_experts = routing(
        rank, world, seed, device, num_tokens=5 + rank, hidden=hidden, experts_per_rank=2
    )
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True,
                            num_qps_per_rank=num_experts // world)  # fmt: skip
    group = buffer.ep_group
    local = num_experts // world
    modes = ((False, False, False, False), (True, False, False, False),
             (True, True, True, False), (True, False, False, True))  # fmt: skip
    for use_fp8, round_scale, use_ue8m0, with_hook in modes:
        tag = f"ll fp8={use_fp8} ue8m0={use_ue8m0} hook={with_hook}"
        stats = torch.zeros(local, dtype=torch.int32, device=device)
        recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
            async_finish=not with_hook, return_recv_hook=with_hook,
        )  # fmt: skip
        if with_hook:
            check(event.event is None, rank, f"{tag}: no event with the hook")
            hook()
        else:
            event.current_stream_wait()
        want = ref.low_latency_dispatch(
            x, topk_idx, max_tokens, num_experts, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, group=group,
        )  # fmt: skip
        got_x, got_scales = recv if use_fp8 else (recv, None)
        check(same_bytes(recv_count, want.recv_count), rank, f"{tag}: recv_count")
        check(torch.equal(stats.cpu(), want.recv_count.cpu()), rank, f"{tag}: stats")
        check(len(handle) == 5 and handle[2:] == (max_tokens, hidden, num_experts), rank,
              f"{tag}: handle ints")  # fmt: skip
        check(same_bytes(handle[1], want.handle.layout_range), rank, f"{tag}: layout_range")
        for e in range(local):
            n = int(want.recv_count[e])
            check(same_bytes(got_x[e, :n], want.recv_x[e, :n]), rank, f"{tag}: recv_x[{e}]")
            check(same_bytes(handle[0][e, :n], want.handle.src_info[e, :n]), rank,
                  f"{tag}: src_info[{e}]")  # fmt: skip
            if use_fp8:
                check(same_bytes(got_scales[e, :n], want.recv_x_scales[e, :n]), rank,
                      f"{tag}: scales[{e}]")  # fmt: skip
        if use_fp8:
            check(got_scales.stride(1) == 1, rank, f"{tag}: scales column-major as DeepEP's")

        y = torch.randn(got_x.shape, generator=torch.Generator().manual_seed(seed + rank))
        y = (y * 0.25).to(BF16).to(device)
        want_c = ref.low_latency_combine(y, topk_idx, topk_weights, want.handle, group=group)
        combined, event, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        check(hook is None and event.event is None, rank, f"{tag}: combine extras")
        _close(combined, want_c, rank, f"{tag}: combine")

    # out=, zero-copy and the hook of a combine (SGLang's two-batch overlap).
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, max_tokens, num_experts,
                                                        use_fp8=False)  # fmt: skip
    want = ref.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, use_fp8=False,
                                    group=group)  # fmt: skip
    y = (recv.float() * 0.5).to(BF16)
    want_c = ref.low_latency_combine(y, topk_idx, topk_weights, want.handle, group=group)
    buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    out = torch.empty(x.shape, dtype=BF16, device=device)
    combined, _, hook = buffer.low_latency_combine(
        torch.empty_like(y), topk_idx, topk_weights, handle, zero_copy=True, out=out,
        return_recv_hook=True,
    )  # fmt: skip
    hook()
    check(combined is out, rank, "combine out=")
    _close(out, want_c, rank, "zero-copy combine")

    # LogFMT: the combine of the LogFMT-rounded expert outputs.
    combined, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle, use_logfmt=True)
    want_l = ref.low_latency_combine(logfmt.encode_decode(y), topk_idx, topk_weights,
                                     want.handle, group=group)  # fmt: skip
    _close(combined, want_l, rank, "LogFMT combine")
    buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)


def _close(got: torch.Tensor, want: torch.Tensor, rank: int, what: str) -> None:
    """Bitwise on the ATen path (CPU); within float32-accumulation tolerance on NVSHMEM."""
    if got.is_cuda:
        ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    else:
        ok = same_bytes(got, want)
    check(ok, rank, what)
