"""Replays of how vLLM and SGLang drive DeepEP's ``Buffer``, written for these tests.

Each replay follows the call sequence of the framework's DeepEP integration (vLLM's
``deepep_ht_prepare_finalize.py`` / ``deepep_ll_prepare_finalize.py``, SGLang's
``token_dispatcher/deepep.py`` normal and low-latency dispatchers): the same methods, keyword
names, flags and handling of the returned tuples. The experts in between are a toy: expert
``e`` scales its input by ``1 + e / 8``, so the MoE output of token ``t`` is
``sum_k w[t, k] * (1 + e_k / 8) * x[t]``, which ``expected_moe`` computes locally.
"""

from __future__ import annotations

import torch

BF16 = torch.bfloat16


def expert_scale(global_expert: torch.Tensor) -> torch.Tensor:
    return 1.0 + global_expert.float() / 8.0


def expected_moe(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    valid = topk_idx >= 0
    factor = (topk_weights * expert_scale(topk_idx.clamp(min=0)) * valid).sum(dim=1)
    return x.float() * factor.unsqueeze(1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-6))


def _dequant(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 rows times their per-128-channel scales (what a framework does before BF16 math)."""
    experts, rows, hidden = x_fp8.shape if x_fp8.dim() == 3 else (1, *x_fp8.shape)
    blocks = x_fp8.float().reshape(experts, rows, hidden // 128, 128)
    return (blocks * scales.float().reshape(experts, rows, hidden // 128, 1)).reshape(x_fp8.shape)


def vllm_high_throughput(buffer, x, topk_ids, topk_weights, num_experts, rank, use_fp8):
    """vLLM's DeepEPHTPrepareAndFinalize: prepare (layout, dispatch), experts, finalize."""
    import deep_ep

    world = buffer.group_size
    rank_expert_offset = rank * (num_experts // world)
    token_data = x
    if use_fp8:
        from ep_backend import reference

        token_data = reference.quantize_fp8_per128(x)
    config = deep_ep.Buffer.get_dispatch_config(world) if world in (2, 4, 8) else None
    (num_tokens_per_rank, num_tokens_per_rdma_rank, expert_num_tokens, is_token_in_rank, _) = (
        buffer.get_dispatch_layout(
            topk_idx=topk_ids, num_experts=num_experts, previous_event=None,
            async_finish=False, allocate_on_comm_stream=False,
        )
    )  # fmt: skip
    (token_data, expert_topk_ids, expert_topk_weights, _, handle, _) = buffer.dispatch(
        x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=expert_num_tokens, topk_idx=topk_ids, topk_weights=topk_weights,
        expert_alignment=1, config=config, previous_event=None, async_finish=False,
        allocate_on_comm_stream=False,
    )  # fmt: skip
    if use_fp8:
        expert_x = _dequant(*token_data).to(BF16)
    else:
        expert_x = token_data
    # vLLM moves the local ids back to global ones (-1 to an expert the expert map drops).
    global_ids = torch.where(
        expert_topk_ids == -1,
        num_experts - 1 if rank_expert_offset == 0 else 0,
        expert_topk_ids + rank_expert_offset,
    )
    local = (expert_topk_ids >= 0).float()
    factor = (expert_topk_weights * expert_scale(global_ids) * local).sum(dim=1, keepdim=True)
    fused_expert_output = (expert_x.float() * factor).to(BF16)
    combined_x, _, _ = buffer.combine(
        x=fused_expert_output, handle=handle, topk_weights=None,
        config=deep_ep.Buffer.get_combine_config(world), previous_event=None,
        async_finish=False, allocate_on_comm_stream=False,
    )  # fmt: skip
    output = torch.empty_like(x)
    output.copy_(combined_x, non_blocking=True)
    return output


def vllm_low_latency(buffer, x, topk_ids, topk_weights, num_experts, max_tokens, use_fp8):
    """vLLM's DeepEPLLPrepareAndFinalize: low_latency_dispatch, batched experts, combine(out=)."""
    expert_x, expert_num_tokens, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_ids, max_tokens, num_experts, use_fp8=use_fp8, async_finish=False,
        return_recv_hook=False,
    )  # fmt: skip
    if use_fp8:
        x_fp8, scales = expert_x
        assert x_fp8.is_contiguous()
        expert_x = _dequant(x_fp8, scales.contiguous()).to(BF16)
    local = num_experts // buffer.group_size
    first = buffer.rank * local
    scale = expert_scale(torch.arange(first, first + local, device=x.device))
    fused_expert_output = (expert_x.float() * scale.view(-1, 1, 1)).to(BF16)
    assert expert_num_tokens.shape == (local,)
    output = torch.empty_like(x)
    buffer.low_latency_combine(
        fused_expert_output, topk_ids, topk_weights, handle, async_finish=False,
        zero_copy=False, return_recv_hook=False, out=output,
    )  # fmt: skip
    return output


def sglang_normal(buffer, x, topk_ids, topk_weights, num_experts, async_finish, alignment):
    """SGLang's _DeepEPDispatcherImplNormal: dispatch_a/b, experts, combine_a/b."""
    import deep_ep

    topk_ids = topk_ids.to(torch.int64)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     previous_event) = buffer.get_dispatch_layout(
        topk_ids, num_experts, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=previous_event is not None,
    )  # fmt: skip
    (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event) = (
        buffer.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=(previous_event is not None) and async_finish,
            expert_alignment=alignment, config=None,
        )
    )  # fmt: skip
    if async_finish:
        event.current_stream_wait()
    assert all(n % alignment == 0 for n in num_recv_tokens_per_expert)
    local = num_experts // buffer.group_size
    global_ids = recv_topk_ids + buffer.rank * local
    valid = (recv_topk_ids >= 0).float()
    factor = (recv_topk_weights * expert_scale(global_ids) * valid).sum(dim=1, keepdim=True)
    hidden_states = (recv_x.float() * factor).to(BF16)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    combined_x, _, event = buffer.combine(
        hidden_states, handle, async_finish=async_finish, previous_event=previous_event,
        allocate_on_comm_stream=previous_event is not None, config=None,
    )  # fmt: skip
    if async_finish:
        event.current_stream_wait()
    return combined_x


def sglang_low_latency(buffer, x, topk_ids, topk_weights, num_experts, max_tokens, use_fp8,
                       return_recv_hook, clean_first):  # fmt: skip
    """SGLang's _DeepEPDispatcherImplLowLatency (auto mode cleans after normal calls)."""
    if clean_first:
        buffer.clean_low_latency_buffer(max_tokens, x.shape[1], num_experts)
    topk_ids = topk_ids.to(torch.int64)
    expected_m = (x.shape[0] * buffer.group_size * topk_ids.shape[1] + num_experts) // num_experts
    assert expected_m >= 0
    packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_ids, max_tokens, num_experts, use_fp8=use_fp8,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook,
    )  # fmt: skip
    hook() if return_recv_hook else event.current_stream_wait()
    if isinstance(packed_recv_hidden, tuple):
        hidden_states = _dequant(*packed_recv_hidden).to(BF16)
    else:
        hidden_states = packed_recv_hidden
    local = num_experts // buffer.group_size
    first = buffer.rank * local
    scale = expert_scale(torch.arange(first, first + local, device=x.device))
    hidden_states = (hidden_states.float() * scale.view(-1, 1, 1)).to(BF16)
    assert packed_recv_count.dtype == torch.int32
    combined, event, hook = buffer.low_latency_combine(
        x=hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook,
    )  # fmt: skip
    hook() if return_recv_hook else event.current_stream_wait()
    return combined
