"""Executable specification of the ``ep_backend`` MoE collectives, in plain PyTorch.

Every function here defines, bit for bit, what the fast implementations must return. It uses only
``torch.distributed.all_to_all_single`` (plus one ``all_reduce`` for the ``num_worst_tokens``
capacity check) on the given ``group``, so it runs on CPU with Gloo and on CUDA with NCCL alike.
Clarity wins over speed: there are loops over ranks, experts and top-k slots, never over tokens.
The prose version of this contract is ``docs/semantics.md``.

Notation: ``T`` tokens on this rank (may differ per rank, may be 0), ``H`` hidden size, ``K``
top-k, ``E`` experts, ``R`` ranks (the group size), ``E_loc = E // R`` experts per rank; global
expert ``e`` lives on rank ``e // E_loc`` under the local id ``e % E_loc``. ``N`` received rows,
``M`` = ``num_max_dispatch_tokens_per_rank``.

Payloads travel as raw bytes (``uint8`` views of contiguous tensors), because Gloo's all-to-all
does not know float8 dtypes: every dispatched value is a bitwise copy of what the sender held.

This module imports only ``torch`` and ``.handles``; it never loads the C++ extension.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .handles import (
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)

__all__ = [
    "FP8_GROUP_SIZE",
    "FP8_MAX",
    "combine",
    "dequantize_fp8_per128",
    "dispatch",
    "get_dispatch_layout",
    "low_latency_combine",
    "low_latency_dispatch",
    "pack_ue8m0",
    "quantize_fp8_per128",
    "unpack_ue8m0",
]

FP8_MAX = 448.0
"""Largest finite magnitude of ``torch.float8_e4m3fn``; quantised values are clamped to it."""

FP8_GROUP_SIZE = 128
"""Channels sharing one FP8 scale."""

_UE8M0_PER_INT32 = 4

Group = dist.ProcessGroup | None


# --------------------------------------------------------------------------------------------
# Communication helpers
# --------------------------------------------------------------------------------------------


def _rows_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View the rows of ``t`` (``[n, *row]``, any dtype) as uint8 ``[n, row_bytes]``."""
    row_numel = 1
    for d in t.shape[1:]:
        row_numel *= d
    rows = t.contiguous().reshape(t.shape[0], row_numel)
    if rows.stride(-1) != 1:  # a size-1 or empty dimension may keep any stride (even 0)
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.uint8)


def _all_to_all_rows(
    t: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group
) -> torch.Tensor:
    """Exchange rows between ranks, bitwise exact, for any dtype.

    Args:
        t: ``[sum(send_counts), *row]``; rows ``[off_r, off_r + send_counts[r])`` go to rank ``r``.
        send_counts: rows sent to each rank (length ``R``).
        recv_counts: rows received from each rank (length ``R``).
        group: process group.

    Returns:
        ``[sum(recv_counts), *row]`` of ``t.dtype`` on ``t.device``: the rows from rank 0 first,
        then rank 1, ...; each rank's rows in the order it sent them.
    """
    send_counts = [int(c) for c in send_counts]
    recv_counts = [int(c) for c in recv_counts]
    assert t.shape[0] == sum(send_counts), "row count does not match the send counts"
    send = _rows_as_bytes(t)
    recv = send.new_empty((sum(recv_counts), send.shape[1]))
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=recv_counts,
        input_split_sizes=send_counts,
        group=group,
    )
    return recv.view(t.dtype).reshape(sum(recv_counts), *t.shape[1:])


def _all_to_all_rows_among_live(
    t: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: Group,
    masked: Sequence[int],
) -> torch.Tensor:
    """``_all_to_all_rows`` among the ranks not in ``masked`` only (point to point).

    A masked rank takes no part (it need not even call this); the counts to and from it must be
    zero. Same arguments and result as ``_all_to_all_rows``.
    """
    num_ranks, rank = _group_size_and_rank(group)
    send_counts = [int(c) for c in send_counts]
    recv_counts = [int(c) for c in recv_counts]
    assert all(send_counts[r] == 0 and recv_counts[r] == 0 for r in masked), (
        "rows to or from a masked rank"
    )
    send = _rows_as_bytes(t)
    recv = send.new_empty((sum(recv_counts), send.shape[1]))
    send_off = [0, *itertools.accumulate(send_counts)]
    recv_off = [0, *itertools.accumulate(recv_counts)]
    works = []
    for r in range(num_ranks):
        mine, theirs = send[send_off[r] : send_off[r + 1]], recv[recv_off[r] : recv_off[r + 1]]
        if r == rank:
            theirs.copy_(mine)
            continue
        peer = r if group is None else dist.get_global_rank(group, r)
        if mine.shape[0] > 0:
            works.append(dist.isend(mine.contiguous(), peer, group=group))
        if theirs.shape[0] > 0:
            works.append(dist.irecv(theirs, peer, group=group))
    for work in works:
        assert work is not None, "isend / irecv on a group this rank is in"
        work.wait()
    return recv.view(t.dtype).reshape(sum(recv_counts), *t.shape[1:])


def _exchange_per_rank(
    values: torch.Tensor, group: Group, masked: Sequence[int] | None = None
) -> torch.Tensor:
    """Send ``values[r]`` to rank ``r``; return ``out`` with ``out[s]`` = what rank ``s`` sent.

    ``values`` is ``[R, *row]``; the result has the same shape and dtype. With ``masked``, only
    the other ranks take part, and ``out[s]`` of a masked ``s`` is zero.
    """
    num_ranks = values.shape[0]
    if masked is None:
        ones = [1] * num_ranks
        return _all_to_all_rows(values, ones, ones, group)
    live = [0 if r in masked else 1 for r in range(num_ranks)]
    received = _all_to_all_rows_among_live(values[[r for r in range(num_ranks) if live[r]]],
                                           live, live, group, masked)  # fmt: skip
    out = values.new_zeros(values.shape)
    out[[r for r in range(num_ranks) if live[r]]] = received
    return out


def _check_mask(mask: Sequence[int] | None, num_ranks: int, rank: int) -> list[int] | None:
    """``mask`` as a sorted list of masked ranks (None: no masking), checked."""
    if mask is None:
        return None
    masked = sorted({int(r) for r in mask})
    assert all(0 <= r < num_ranks for r in masked), f"mask names ranks outside the group: {mask}"
    assert rank not in masked, "a masked rank takes no part in the call"
    return masked


def _without_masked_ranks(
    topk_idx: torch.Tensor, masked: Sequence[int], experts_per_rank: int
) -> torch.Tensor:
    """``topk_idx`` with every entry naming an expert of a masked rank set to -1 (absent)."""
    if not masked:
        return topk_idx
    on_masked = torch.zeros_like(topk_idx, dtype=torch.bool)
    for r in masked:
        on_masked |= (topk_idx >= r * experts_per_rank) & (topk_idx < (r + 1) * experts_per_rank)
    return torch.where(on_masked, torch.full_like(topk_idx, -1), topk_idx)


def _group_size_and_rank(group: Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_handle_group(handle: DispatchHandle | LowLatencyHandle, group: Group) -> int:
    """Asserts that ``group`` has the size of the group that made ``handle``; returns it (``R``)."""
    num_ranks, _ = _group_size_and_rank(group)
    assert handle.num_ranks == num_ranks, "the handle was made on a group of another size"
    return num_ranks


def _pad_rows(t: torch.Tensor | None, num_rows: int, fill_value: int | float) -> Any:
    """Return ``t`` extended to ``num_rows`` rows; the extra rows are ``fill_value`` (``None``
    stays ``None``)."""
    if t is None:
        return None
    shape = (num_rows, *t.shape[1:])
    out = t.new_zeros(shape) if fill_value == 0 else t.new_full(shape, fill_value)
    out[: t.shape[0]] = t
    return out


def _exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(t, dim=dim) - t


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def _check_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> None:
    assert topk_idx.dim() == 2, f"topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}"
    assert topk_idx.dtype in (torch.int32, torch.int64), (
        f"topk_idx must be int32 or int64, got {topk_idx.dtype}"
    )
    if topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        assert lo >= -1 and hi < num_experts, (
            f"topk_idx values must lie in [-1, {num_experts}), got [{lo}, {hi}]"
        )


def tokens_per_node(is_token_in_rank: torch.Tensor, node_of_rank: Sequence[int]) -> torch.Tensor:
    """Tokens sent to each node: int32 ``[num_nodes]``, token ``t`` counted once for node ``n``
    when it goes to at least one rank of ``n`` (DeepEP's ``num_tokens_per_rdma_rank``: a token
    crosses the inter-node leg at most once per destination node).

    Args:
        is_token_in_rank: bool ``[T, R]``.
        node_of_rank: ``[R]`` node index of each rank, nodes ``0..num_nodes-1``.
    """
    num_ranks = is_token_in_rank.shape[1]
    if len(node_of_rank) != num_ranks:
        raise ValueError(
            f"node_of_rank names {len(node_of_rank)} ranks, the layout has {num_ranks}"
        )
    num_nodes = max(node_of_rank) + 1 if num_ranks else 0
    per_node = num_ranks // num_nodes if num_nodes else 0
    contiguous = per_node > 0 and list(node_of_rank) == [r // per_node for r in range(num_ranks)]
    if contiguous:
        in_node = is_token_in_rank.view(-1, num_nodes, per_node).any(dim=2)
    else:
        in_node = torch.stack(
            [is_token_in_rank[:, [r for r in range(num_ranks) if node_of_rank[r] == n]].any(dim=1)
             for n in range(num_nodes)], dim=1)  # fmt: skip
    return in_node.sum(dim=0, dtype=torch.int32)


def get_dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    node_of_rank: Sequence[int] | None = None,
) -> DispatchLayout:
    """Count what a dispatch will send (local computation, no communication).

    Args:
        topk_idx: int64 or int32 ``[T, K]`` global expert ids, ``-1`` = no expert.
        num_experts: ``E``; must be a multiple of ``num_ranks``.
        num_ranks: ``R``.
        node_of_rank: ``[R]`` node of each rank (``ep_backend.topology(group).node_of_rank``);
            default: one node. Only ``num_tokens_per_node`` depends on it.

    Returns:
        ``DispatchLayout`` on ``topk_idx.device``:
        ``num_tokens_per_rank`` int32 ``[R]`` (tokens with at least one expert on rank ``r``,
        counted once per rank), ``num_tokens_per_expert`` int32 ``[E]`` (``(t, k)`` entries equal
        to ``e``), ``is_token_in_rank`` bool ``[T, R]``, ``send_pos`` int32 ``[T, R]``
        (position of ``t`` among the tokens sent to ``r``, ``-1`` where not sent),
        ``num_tokens_per_node`` int32 ``[num_nodes]`` (``tokens_per_node``).
    """
    _check_topk_idx(topk_idx, num_experts)
    assert num_experts % num_ranks == 0, "num_experts must be a multiple of the number of ranks"
    experts_per_rank = num_experts // num_ranks
    idx = topk_idx.long()
    valid = idx >= 0

    num_tokens_per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    dest_rank = idx.div(experts_per_rank, rounding_mode="floor")
    is_token_in_rank = torch.zeros(
        (idx.shape[0], num_ranks), dtype=torch.bool, device=topk_idx.device
    )
    for r in range(num_ranks):
        is_token_in_rank[:, r] = (valid & (dest_rank == r)).any(dim=1)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
    sent = is_token_in_rank.to(torch.int32)
    send_pos = torch.where(is_token_in_rank, sent.cumsum(dim=0) - 1, -1).to(torch.int32)
    nodes = tuple(node_of_rank) if node_of_rank is not None else (0,) * num_ranks
    return DispatchLayout(
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, send_pos,
        _node_of_rank=nodes, _per_node=tokens_per_node(is_token_in_rank, nodes),
    )  # fmt: skip


def _send_plan(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows a high-throughput dispatch sends, in send order.

    Returns:
        ``send_token`` int64 ``[S]`` (source token index of each sent row: destination rank
        ascending, then token index ascending), ``send_dest`` int64 ``[S]`` (its destination
        rank) and ``send_counts`` (rows per destination rank, a list of ``R`` ints).
    """
    num_ranks = is_token_in_rank.shape[1]
    tokens = [is_token_in_rank[:, r].nonzero().squeeze(1) for r in range(num_ranks)]
    send_counts = [int(t.numel()) for t in tokens]
    send_token = torch.cat(tokens)
    send_dest = torch.repeat_interleave(
        torch.arange(num_ranks, device=is_token_in_rank.device),
        torch.tensor(send_counts, device=is_token_in_rank.device, dtype=torch.long),
    )
    return send_token, send_dest, send_counts


# --------------------------------------------------------------------------------------------
# High-throughput dispatch / combine
# --------------------------------------------------------------------------------------------


def _check_capacity(
    num_valid: int, num_worst_tokens: int, device: torch.device, group: Group, what: str
) -> None:
    """Raise on every rank (collectively) if any rank receives more than ``num_worst_tokens``."""
    num_ranks, rank = _group_size_and_rank(group)
    counts = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    counts[rank] = num_valid
    dist.all_reduce(counts, group=group)
    if int(counts.max()) > num_worst_tokens:
        raise RuntimeError(
            f"{what}: num_worst_tokens={num_worst_tokens} is smaller than the rows to receive "
            f"(per rank: {counts.tolist()})"
        )


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    *,
    x_scales: torch.Tensor | None = None,
    handle: DispatchHandle | None = None,
    expert_alignment: int = 1,
    num_worst_tokens: int = 0,
    group: Group = None,
) -> DispatchOutput:
    """High-throughput dispatch: send each token once to every rank owning one of its experts.

    Args:
        x: ``[T, H]`` tokens, any dtype (BF16, float8_e4m3fn, float32, float64); copied bitwise.
        topk_idx: int64 or int32 ``[T, K]`` global expert ids, ``-1`` = none. ``None`` only for a
            cached dispatch.
        topk_weights: float32 ``[T, K]`` or ``None``.
        num_experts: ``E`` (multiple of ``R``); ``None`` only for a cached dispatch.
        x_scales: optional ``[T, S]`` (float32 or int32, e.g. FP8 scales), copied bitwise.
        handle: a previous dispatch's handle: cached dispatch, re-sends the new ``x`` (and
            ``x_scales``) with the same routing; ``topk_idx``, ``topk_weights`` and
            ``num_experts`` must then be ``None``.
        expert_alignment: each entry of ``num_recv_tokens_per_expert`` is rounded up to a
            multiple of it.
        num_worst_tokens: ``0``: outputs have exactly ``N`` valid rows. ``> 0``: every received
            output has exactly ``num_worst_tokens`` rows, the tail being padding (``recv_x`` and
            ``recv_x_scales`` zero here, ``recv_topk_idx``/``recv_src_idx``/``recv_src_rank`` -1,
            ``recv_topk_weights`` 0); ``RuntimeError`` on every rank if some rank would receive
            more rows.
        group: process group (default: WORLD).

    Returns:
        ``DispatchOutput``: ``recv_x`` ``[N, H]`` (dtype of ``x``), rows ordered by source rank
        ascending then source token index ascending; ``recv_x_scales`` ``[N, S]`` or ``None``;
        ``recv_topk_idx`` ``[N, K]`` (dtype of ``topk_idx``) local expert ids (-1 for experts of
        other ranks); ``recv_topk_weights`` float32 ``[N, K]`` (0 where ``recv_topk_idx`` is -1)
        or ``None``; ``num_recv_tokens_per_expert`` int32 ``[E_loc]`` (aligned counts); the same
        as a list (``[]`` with ``num_worst_tokens > 0``); ``handle``; ``work=None``.
        A cached dispatch returns only ``recv_x``/``recv_x_scales`` and the same handle.
    """
    if handle is not None:
        assert topk_idx is None and topk_weights is None and num_experts is None, (
            "a cached dispatch (handle given) takes no topk_idx, topk_weights or num_experts"
        )
        return _cached_dispatch(x, x_scales, handle, group)

    assert topk_idx is not None and num_experts is not None, "dispatch needs topk_idx and E"
    num_ranks, _ = _group_size_and_rank(group)
    num_tokens = x.shape[0]
    assert x.dim() == 2, f"x must be [T, H], got shape {tuple(x.shape)}"
    assert topk_idx.shape[0] == num_tokens, "topk_idx must have one row per token of x"
    if topk_weights is not None:
        assert topk_weights.shape == topk_idx.shape, "topk_weights must match topk_idx"
        assert topk_weights.dtype == torch.float32, "topk_weights must be float32"
    if x_scales is not None:
        assert x_scales.dim() == 2 and x_scales.shape[0] == num_tokens, "x_scales must be [T, S]"
    assert expert_alignment >= 1, "expert_alignment must be >= 1"
    assert num_worst_tokens >= 0, "num_worst_tokens must be >= 0"

    layout = get_dispatch_layout(topk_idx, num_experts, num_ranks)
    experts_per_rank = num_experts // num_ranks

    # 1. Counts: how many rows come from each source rank.
    send_token, send_dest, send_counts = _send_plan(layout.is_token_in_rank)
    num_recv_tokens_per_rank = _exchange_per_rank(layout.num_tokens_per_rank, group)
    recv_counts = num_recv_tokens_per_rank.tolist()
    num_valid = sum(recv_counts)
    if num_worst_tokens > 0:
        _check_capacity(num_valid, num_worst_tokens, x.device, group, "dispatch")

    # 2. Payload rows, with top-k rewritten for the destination rank.
    sent_topk = topk_idx[send_token]  # [S, K] global ids
    dest = send_dest.to(topk_idx.dtype).unsqueeze(1)
    on_dest = (sent_topk >= 0) & (sent_topk.div(experts_per_rank, rounding_mode="floor") == dest)
    sent_local_topk = torch.where(on_dest, sent_topk - dest * experts_per_rank, -1)

    def exchange(t: torch.Tensor) -> torch.Tensor:
        return _all_to_all_rows(t, send_counts, recv_counts, group)

    recv_x = exchange(x[send_token])
    recv_x_scales = exchange(x_scales[send_token]) if x_scales is not None else None
    recv_topk_idx = exchange(sent_local_topk)
    recv_topk_weights = None
    if topk_weights is not None:
        recv_topk_weights = exchange(torch.where(on_dest, topk_weights[send_token], 0.0))
    recv_src_idx = exchange(send_token.to(torch.int32))
    recv_src_rank = torch.repeat_interleave(
        torch.arange(num_ranks, dtype=torch.int32, device=x.device),
        num_recv_tokens_per_rank.to(device=x.device, dtype=torch.long),
    )

    # 3. Per-local-expert counts, rounded up to the alignment.
    selected = recv_topk_idx[recv_topk_idx >= 0].long()
    per_expert = torch.bincount(selected, minlength=experts_per_rank)
    per_expert = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
    num_recv_tokens_per_expert = per_expert.to(device=x.device, dtype=torch.int32)
    per_expert_list = num_recv_tokens_per_expert.tolist() if num_worst_tokens == 0 else []

    # 4. Fixed capacity.
    if num_worst_tokens > 0:
        recv_x = _pad_rows(recv_x, num_worst_tokens, 0)
        recv_x_scales = _pad_rows(recv_x_scales, num_worst_tokens, 0)
        recv_topk_idx = _pad_rows(recv_topk_idx, num_worst_tokens, -1)
        recv_topk_weights = _pad_rows(recv_topk_weights, num_worst_tokens, 0.0)
        recv_src_idx = _pad_rows(recv_src_idx, num_worst_tokens, -1)
        recv_src_rank = _pad_rows(recv_src_rank, num_worst_tokens, -1)

    new_handle = DispatchHandle(
        num_ranks=num_ranks,
        num_experts=num_experts,
        is_token_in_rank=layout.is_token_in_rank,
        num_tokens_per_rank=layout.num_tokens_per_rank,
        num_recv_tokens_per_rank=num_recv_tokens_per_rank.to(device=x.device),
        recv_src_idx=recv_src_idx,
        recv_src_rank=recv_src_rank,
        num_worst_tokens=num_worst_tokens,
    )
    return DispatchOutput(
        recv_x=recv_x,
        recv_x_scales=recv_x_scales,
        recv_topk_idx=recv_topk_idx,
        recv_topk_weights=recv_topk_weights,
        num_recv_tokens_per_expert=num_recv_tokens_per_expert,
        num_recv_tokens_per_expert_list=per_expert_list,
        handle=new_handle,
        work=None,
    )


def _cached_dispatch(
    x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle, group: Group
) -> DispatchOutput:
    """Dispatch ``x`` (and ``x_scales``) along the routing recorded in ``handle``."""
    _check_handle_group(handle, group)
    assert x.dim() == 2 and x.shape[0] == handle.num_tokens, (
        f"x must be [T={handle.num_tokens}, H], got shape {tuple(x.shape)}"
    )
    if x_scales is not None:
        assert x_scales.dim() == 2 and x_scales.shape[0] == handle.num_tokens, (
            "x_scales must be [T, S]"
        )
    send_token, _, send_counts = _send_plan(handle.is_token_in_rank)
    recv_counts = handle.num_recv_tokens_per_rank.tolist()
    recv_x = _all_to_all_rows(x[send_token], send_counts, recv_counts, group)
    recv_x_scales = None
    if x_scales is not None:
        recv_x_scales = _all_to_all_rows(x_scales[send_token], send_counts, recv_counts, group)
    if handle.num_worst_tokens > 0:
        recv_x = _pad_rows(recv_x, handle.num_worst_tokens, 0)
        recv_x_scales = _pad_rows(recv_x_scales, handle.num_worst_tokens, 0)
    return DispatchOutput(
        recv_x=recv_x,
        recv_x_scales=recv_x_scales,
        recv_topk_idx=None,
        recv_topk_weights=None,
        num_recv_tokens_per_expert=None,
        num_recv_tokens_per_expert_list=[],
        handle=handle,
        work=None,
    )


class _RowsHome(NamedTuple):
    """What both combine orders start from: the held rows sent back to their source ranks."""

    num_ranks: int
    biases: tuple[torch.Tensor, ...]
    returned_x: torch.Tensor  # [sum(num_tokens_per_rank), H]: from rank 0 first, token order
    returned_w: torch.Tensor | None  # the same rows of topk_weights
    back_counts: list[int]  # rows returned by each rank


def _rows_home(
    x: torch.Tensor,
    handle: DispatchHandle,
    topk_weights: torch.Tensor | None,
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None,
    group: Group,
) -> _RowsHome:
    """Checks a combine's arguments and sends the held rows (and weights) back: the rows held
    from source rank s return to s, which receives from rank r its tokens with
    ``is_token_in_rank[:, r]``, in token order."""
    num_ranks = _check_handle_group(handle, group)
    assert x.dim() == 2 and x.shape[0] == handle.num_recv_rows, (
        f"x must be [N={handle.num_recv_rows}, H], got shape {tuple(x.shape)}"
    )
    if topk_weights is not None:
        assert topk_weights.dim() == 2 and topk_weights.shape[0] == handle.num_recv_rows, (
            "topk_weights must be [N, K]"
        )
        assert topk_weights.dtype == torch.float32, "topk_weights must be float32"
    biases: tuple[torch.Tensor, ...]
    if bias is None:
        biases = ()
    elif isinstance(bias, torch.Tensor):
        biases = (bias,)
    else:
        biases = tuple(b for b in bias if b is not None)
    assert len(biases) <= 2, "at most two bias tensors"
    for b in biases:
        assert tuple(b.shape) == (handle.num_tokens, x.shape[1]), "each bias must be [T, H]"
    held_counts = handle.num_recv_tokens_per_rank.tolist()
    num_valid = sum(held_counts)
    back_counts = handle.num_tokens_per_rank.tolist()
    returned_x = _all_to_all_rows(x[:num_valid], held_counts, back_counts, group)
    returned_w = None
    if topk_weights is not None:
        returned_w = _all_to_all_rows(topk_weights[:num_valid], held_counts, back_counts, group)
    return _RowsHome(num_ranks, biases, returned_x, returned_w, back_counts)


def combine(
    x: torch.Tensor,
    handle: DispatchHandle,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    group: Group = None,
) -> CombineOutput:
    """High-throughput combine: sum the rows of a dispatch back into their source tokens.

    The reduction order is fixed: for token ``t``, ``acc`` starts at +0.0 in float32 (float64
    when ``x`` is float64); for ``r = 0 .. R-1`` where ``is_token_in_rank[t, r]``:
    ``acc = acc + row_from_r``; then ``acc = acc + b`` for each bias in order; the result is
    ``acc`` cast to ``x.dtype``. No weights are applied to ``x``.

    Args:
        x: ``[N, H]`` rows in the layout of the dispatch that made ``handle``
            (``N = handle.num_recv_rows``; padding rows past the valid count are ignored).
        handle: the ``DispatchHandle`` of that dispatch.
        topk_weights: optional float32 ``[N, K]``; summed back the same way (float32, ranks
            ascending) into ``combined_topk_weights``.
        bias: ``None``, a ``[T, H]`` tensor, or a tuple of up to two ``[T, H]`` tensors, added
            after the rows.
        group: process group (default: WORLD).

    Returns:
        ``CombineOutput``: ``combined_x`` ``[T, H]`` of ``x.dtype``; ``combined_topk_weights``
        float32 ``[T, K]`` or ``None``; ``work=None``. Tokens sent nowhere get the bias (or 0).
    """
    num_ranks, biases, returned_x, returned_w, _ = _rows_home(x, handle, topk_weights, bias, group)
    num_tokens, hidden = handle.num_tokens, x.shape[1]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = torch.zeros((num_tokens, hidden), dtype=acc_dtype, device=x.device)
    acc_w = None
    if returned_w is not None:
        acc_w = torch.zeros((num_tokens, returned_w.shape[1]), dtype=torch.float32, device=x.device)
    offset = 0
    for r in range(num_ranks):
        tokens = handle.is_token_in_rank[:, r].nonzero().squeeze(1)  # unique, ascending
        rows = slice(offset, offset + tokens.numel())
        acc[tokens] = acc[tokens] + returned_x[rows].to(acc_dtype)
        if acc_w is not None and returned_w is not None:
            acc_w[tokens] = acc_w[tokens] + returned_w[rows]
        offset += tokens.numel()
    for b in biases:
        acc = acc + b.to(device=acc.device, dtype=acc_dtype)
    return CombineOutput(combined_x=acc.to(x.dtype), combined_topk_weights=acc_w, work=None)


def combine_by_node(
    x: torch.Tensor,
    handle: DispatchHandle,
    node_of_rank: Sequence[int],
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    group: Group = None,
) -> CombineOutput:
    """``combine`` in the summation order of the hierarchical internode transport.

    The internode transport reduces on the forwarding GPU of each node and sends one partial
    sum per node, so its order differs from ``combine``'s (ranks ascending): for token ``t`` and
    each node ``n`` (ascending) that holds ``t`` on some rank, ``partial_n`` starts at +0.0 in
    float32 and adds the rows of the node's ranks in rank order (the local index order); then
    ``acc`` starts at +0.0 and adds ``partial_n`` for each such node in node order; then each
    bias; the result is ``acc`` cast to ``x.dtype``. The same for ``topk_weights``. With one rank
    per node this is exactly ``combine``'s order (nodes are numbered by their lowest rank); with
    several, float32 rounding may differ from ``combine`` in the last bits. For BF16 and float32
    ``x`` (the dtypes the internode kernels sum).

    Args: as ``combine``, plus ``node_of_rank`` (``[R]``, e.g. ``ep_backend.topology().node_of_rank``).
    Returns: as ``combine``.
    """
    assert x.dtype in (torch.bfloat16, torch.float32), "combine_by_node sums BF16 or float32 rows"
    # Checked before _rows_home's exchange, as its own arguments are: a rank never raises
    # after its peers have sent it rows.
    assert len(node_of_rank) == _group_size_and_rank(group)[0], (
        "node_of_rank must name the node of every rank"
    )
    num_ranks, biases, returned_x, returned_w, back_counts = _rows_home(
        x, handle, topk_weights, bias, group
    )
    num_tokens, hidden = handle.num_tokens, x.shape[1]
    offsets = [0]
    for c in back_counts:
        offsets.append(offsets[-1] + c)
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    acc_w = None
    if returned_w is not None:
        acc_w = torch.zeros((num_tokens, returned_w.shape[1]), dtype=torch.float32, device=x.device)
    for node in sorted(set(node_of_rank)):
        part = torch.zeros_like(acc)
        part_w = torch.zeros_like(acc_w) if acc_w is not None else None
        visited = torch.zeros(num_tokens, dtype=torch.bool, device=x.device)
        for r in range(num_ranks):
            if node_of_rank[r] != node:
                continue
            tokens = handle.is_token_in_rank[:, r].nonzero().squeeze(1)
            rows = slice(offsets[r], offsets[r + 1])
            part[tokens] = part[tokens] + returned_x[rows].to(torch.float32)
            if part_w is not None and returned_w is not None:
                part_w[tokens] = part_w[tokens] + returned_w[rows]
            visited[tokens] = True
        acc[visited] = acc[visited] + part[visited]
        if acc_w is not None and part_w is not None:
            acc_w[visited] = acc_w[visited] + part_w[visited]
    for b in biases:
        acc = acc + b.to(device=acc.device, dtype=torch.float32)
    return CombineOutput(combined_x=acc.to(x.dtype), combined_topk_weights=acc_w, work=None)


# --------------------------------------------------------------------------------------------
# FP8 per-128-channel quantisation
# --------------------------------------------------------------------------------------------


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales ``[..., G]`` (``G % 4 == 0``) as UE8M0 bytes.

    Returns int32 ``[..., G/4]``: the biased exponent byte ``(bits >> 23) & 0xFF`` of group
    ``4i + j`` sits in byte ``j`` (bits ``8j .. 8j+7``, little-endian) of int32 ``i``.
    """
    assert scales.dtype == torch.float32, "scales must be float32"
    groups = scales.shape[-1]
    assert groups % _UE8M0_PER_INT32 == 0, "the number of groups must be a multiple of 4"
    exponents = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.int64)
    exponents = exponents.reshape(*scales.shape[:-1], groups // _UE8M0_PER_INT32, 4)
    packed = torch.zeros(exponents.shape[:-1], dtype=torch.int64, device=scales.device)
    for j in range(_UE8M0_PER_INT32):
        packed |= exponents[..., j] << (8 * j)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as signed
    return packed.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_ue8m0``: int32 ``[..., G/4]`` -> float32 scales ``[..., G]``."""
    assert packed.dtype == torch.int32, "packed UE8M0 scales must be int32"
    bits = packed.to(torch.int64) & 0xFFFFFFFF
    exponents = torch.stack([(bits >> (8 * j)) & 0xFF for j in range(_UE8M0_PER_INT32)], dim=-1)
    exponents = exponents.reshape(*packed.shape[:-1], packed.shape[-1] * _UE8M0_PER_INT32)
    return (exponents << 23).to(torch.int32).view(torch.float32)


def quantize_fp8_per128(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to float8_e4m3fn with one scale per 128 consecutive channels.

    For each group of 128 channels (in float32): ``amax = max|x|`` clamped to ``>= 1e-4``;
    ``scale = amax / 448`` (a correctly rounded division, not ``amax * (1 / 448)``); with
    ``round_scale`` the scale is rounded up to a power of two by bits
    (``((bits + 0x7FFFFF) & 0x7F800000)``); ``inv = 1 / scale`` (correctly rounded);
    ``q = clamp(x * inv, -448, 448)`` cast to float8_e4m3fn (round to nearest even, no FMA
    anywhere). ``x ~= q * scale``.

    Args:
        x: BF16 or float32 ``[..., H]`` with ``H % 128 == 0``.
        round_scale: round scales up to powers of two.
        use_ue8m0: return the scales packed as UE8M0 (requires ``round_scale`` and
            ``H % 512 == 0``).

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn ``[..., H]``; ``scales`` float32 ``[..., H/128]``,
        or with ``use_ue8m0`` int32 ``[..., H/512]`` (see ``pack_ue8m0``). Both contiguous.
    """
    hidden = x.shape[-1]
    assert hidden % FP8_GROUP_SIZE == 0, f"H must be a multiple of 128, got {hidden}"
    if use_ue8m0:
        assert round_scale, "use_ue8m0 requires round_scale"
        assert hidden % (FP8_GROUP_SIZE * _UE8M0_PER_INT32) == 0, "use_ue8m0 needs H % 512 == 0"
    groups = hidden // FP8_GROUP_SIZE
    xf = x.float().reshape(*x.shape[:-1], groups, FP8_GROUP_SIZE)
    amax = xf.abs().amax(dim=-1).clamp(min=1e-4)
    # A true IEEE division: on CUDA, ``tensor / python_float`` multiplies by the rounded
    # reciprocal instead, which differs in the last bit for about half the inputs.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        bits = scale.view(torch.int32).to(torch.int64)
        bits = (bits + 0x7FFFFF) & 0x7F800000
        scale = bits.to(torch.int32).view(torch.float32)
    inv_scale = torch.reciprocal(scale)  # IEEE 1 / scale on CPU and CUDA alike
    q = (xf * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(x.shape)
    if use_ue8m0:
        return q, pack_ue8m0(scale)
    return q, scale.contiguous()


def dequantize_fp8_per128(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Undo ``quantize_fp8_per128``: float32 ``[..., H]`` = ``q * scale`` per 128 channels.

    Args:
        x_fp8: float8_e4m3fn ``[..., H]``.
        scales: float32 ``[..., H/128]`` or packed UE8M0 int32 ``[..., H/512]``.
    """
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    hidden = x_fp8.shape[-1]
    groups = hidden // FP8_GROUP_SIZE
    assert scales.shape[-1] == groups, "scales do not match the hidden size"
    xf = x_fp8.float().reshape(*x_fp8.shape[:-1], groups, FP8_GROUP_SIZE)
    return (xf * scales.float().unsqueeze(-1)).reshape(x_fp8.shape)


# --------------------------------------------------------------------------------------------
# Low-latency dispatch / combine
# --------------------------------------------------------------------------------------------


def _ll_send_plan(
    topk_idx: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries a low-latency dispatch sends: one per ``(t, k)`` with ``topk_idx[t, k] >= 0``.

    Returns:
        ``entry_token`` and ``entry_k`` int64 ``[n]``, ordered by global expert ascending (so by
        destination rank, then local expert), then ``t``, then ``k``; and ``per_expert`` int64
        ``[E]``, entries per global expert.
    """
    num_topk = topk_idx.shape[1]
    flat = topk_idx.long().reshape(-1)  # position p = t * K + k
    positions = (flat >= 0).nonzero().squeeze(1)
    experts = flat[positions]
    order = torch.sort(experts, stable=True).indices
    positions = positions[order]
    per_expert = torch.bincount(experts, minlength=num_experts)
    return positions // num_topk, positions % num_topk, per_expert


def _decode_layout_range(layout_range: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(begin, count)`` int64 ``[E_loc, R]`` from ``(begin << 32) | count``."""
    return layout_range >> 32, layout_range & 0xFFFFFFFF


def low_latency_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    *,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    group: Group = None,
    mask: Sequence[int] | None = None,
) -> LowLatencyDispatchOutput:
    """Low-latency dispatch: one row per ``(token, selected expert)`` into a per-expert layout.

    For local expert ``le`` of the receiving rank, rows are packed from slot 0: all rows from
    source rank 0, then rank 1, ...; within a source rank by source token index, then ``k``.
    With ``use_fp8`` each token is quantised by its sender (``quantize_fp8_per128``).

    Rank masking (``mask``, the ranks masked; called by the live ranks only): every entry of
    ``topk_idx`` naming an expert of a masked rank counts as ``-1``, and a masked source sends
    nothing (its ``layout_range`` counts are 0). The result is that of the unmasked call in
    which the masked ranks passed ``T = 0`` and the live ranks' entries on masked ranks were -1.

    Args:
        x: BF16 ``[T, H]``, ``T <= M``, ``H % 128 == 0``.
        topk_idx: int64 or int32 ``[T, K]`` global expert ids, ``-1`` = none.
        num_max_dispatch_tokens_per_rank: ``M`` (same on all ranks).
        num_experts: ``E`` (multiple of ``R``).
        use_fp8: send float8_e4m3fn + scales instead of BF16.
        round_scale: round FP8 scales up to powers of two.
        use_ue8m0: pack the scales as UE8M0 (needs ``round_scale`` and ``H % 512 == 0``).
        cumulative_local_expert_recv_stats: optional int32 ``[E_loc]``; ``+= recv_count``.
        group: process group (default: WORLD).
        mask: ranks masked (``ep_backend.low_latency_update_mask``), or None.

    Returns:
        ``LowLatencyDispatchOutput``: ``recv_x`` ``[E_loc, R*M, H]`` BF16 or float8_e4m3fn
        (zero past ``recv_count`` here); ``recv_x_scales`` float32 ``[E_loc, R*M, H/128]``,
        int32 ``[E_loc, R*M, H/512]`` (UE8M0) or ``None``; ``recv_count`` int32 ``[E_loc]``;
        ``handle`` (``src_info`` int32 ``[E_loc, R*M]``, -1 past ``recv_count``;
        ``layout_range`` int64 ``[E_loc, R]``); ``hook=None``; ``work=None``.
    """
    num_ranks, rank = _group_size_and_rank(group)
    masked = _check_mask(mask, num_ranks, rank)
    max_tokens = num_max_dispatch_tokens_per_rank
    assert x.dim() == 2 and x.dtype == torch.bfloat16, "x must be BF16 [T, H]"
    num_tokens, hidden = x.shape
    assert num_tokens <= max_tokens, f"T={num_tokens} exceeds M={max_tokens}"
    assert hidden % FP8_GROUP_SIZE == 0, f"H must be a multiple of 128, got {hidden}"
    assert topk_idx.shape[0] == num_tokens, "topk_idx must have one row per token of x"
    assert num_experts % num_ranks == 0, "num_experts must be a multiple of the number of ranks"
    assert not use_ue8m0 or use_fp8, "use_ue8m0 requires use_fp8"
    _check_topk_idx(topk_idx, num_experts)
    experts_per_rank = num_experts // num_ranks
    slots = num_ranks * max_tokens
    if masked is not None:
        topk_idx = _without_masked_ranks(topk_idx, masked, experts_per_rank)

    # Sender: entries sorted by (destination rank, local expert, token, k).
    entry_token, _, per_expert = _ll_send_plan(topk_idx, num_experts)
    assert int(per_expert.max()) <= max_tokens, "a rank may send at most M rows to one expert"
    send_matrix = per_expert.reshape(num_ranks, experts_per_rank)  # [dest rank, local expert]
    # [src rank, local expert]
    recv_matrix = _exchange_per_rank(send_matrix, group, masked).to(x.device)
    send_counts = send_matrix.sum(dim=1).tolist()
    recv_counts = recv_matrix.sum(dim=1).tolist()

    def exchange(t: torch.Tensor) -> torch.Tensor:
        if masked is not None:
            return _all_to_all_rows_among_live(t, send_counts, recv_counts, group, masked)
        return _all_to_all_rows(t, send_counts, recv_counts, group)

    if use_fp8:
        x_q, x_scales = quantize_fp8_per128(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
        recv_rows = exchange(x_q[entry_token])
        recv_scale_rows: torch.Tensor | None = exchange(x_scales[entry_token])
    else:
        recv_rows = exchange(x[entry_token])
        recv_scale_rows = None
    recv_src = exchange(entry_token.to(torch.int32))

    # Receiver: the received buffer holds segments (src rank s, local expert le) in that order;
    # segment (s, le) goes to slots begin[s, le] .. begin[s, le] + count of expert le, where
    # begin packs the source ranks of one expert one after the other.
    seg_count = recv_matrix.reshape(-1)  # [R * E_loc], index s * E_loc + le
    seg_begin = _exclusive_cumsum(recv_matrix, dim=0).reshape(-1)
    seg_offset = _exclusive_cumsum(seg_count)
    seg_expert = torch.arange(experts_per_rank, device=x.device).repeat(num_ranks)
    entry_seg = torch.repeat_interleave(torch.arange(seg_count.numel(), device=x.device), seg_count)
    entry_pos = torch.arange(entry_seg.numel(), device=x.device)
    entry_slot = seg_begin[entry_seg] + entry_pos - seg_offset[entry_seg]
    entry_expert = seg_expert[entry_seg]

    recv_x = x.new_zeros((experts_per_rank, slots, hidden), dtype=recv_rows.dtype)
    recv_x[entry_expert, entry_slot] = recv_rows
    recv_x_scales = None
    if recv_scale_rows is not None:
        recv_x_scales = recv_scale_rows.new_zeros(
            (experts_per_rank, slots, recv_scale_rows.shape[1])
        )
        recv_x_scales[entry_expert, entry_slot] = recv_scale_rows
    src_info = torch.full((experts_per_rank, slots), -1, dtype=torch.int32, device=x.device)
    src_info[entry_expert, entry_slot] = recv_src

    begin = _exclusive_cumsum(recv_matrix, dim=0).t()  # [E_loc, R]
    layout_range = (begin << 32) | recv_matrix.t()
    recv_count = recv_matrix.sum(dim=0).to(torch.int32)
    if cumulative_local_expert_recv_stats is not None:
        assert cumulative_local_expert_recv_stats.dtype == torch.int32, "stats must be int32"
        assert tuple(cumulative_local_expert_recv_stats.shape) == (experts_per_rank,), (
            "stats must be [E_loc]"
        )
        cumulative_local_expert_recv_stats += recv_count.to(
            cumulative_local_expert_recv_stats.device
        )

    handle = LowLatencyHandle(
        src_info=src_info,
        layout_range=layout_range.contiguous(),
        num_max_dispatch_tokens_per_rank=max_tokens,
        hidden=hidden,
        num_experts=num_experts,
        num_ranks=num_ranks,
        buffer_index=0,
    )
    return LowLatencyDispatchOutput(
        recv_x=recv_x,
        recv_x_scales=recv_x_scales,
        recv_count=recv_count,
        handle=handle,
        hook=None,
        work=None,
    )


def _sum_of_rank_partials(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    y: torch.Tensor,
    experts_per_rank: int,
    bf16_partials: bool,
) -> torch.Tensor:
    """``low_latency_combine``'s sum with ``per_rank_partials`` (see there): ``topk_idx`` without
    masked ranks, ``y`` float32 ``[T, K, H]`` the returned rows in their entries' places."""
    num_topk = topk_idx.shape[1]
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx.long() // experts_per_rank, -1)
    # Each product rounded to float32 once, as the kernels form it.
    weighted = [topk_weights[:, j].unsqueeze(1) * y[:, j] for j in range(num_topk)]
    acc = torch.zeros((y.shape[0], y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(num_topk):
        first = valid[:, k].clone()  # the token's first entry on rank dest[:, k]
        for j in range(k):
            first &= dest[:, j] != dest[:, k]
        partial = torch.zeros_like(acc)
        entries = torch.zeros_like(dest[:, k])
        for j in range(k, num_topk):
            on_d = valid[:, j] & (dest[:, j] == dest[:, k])
            partial = torch.where(on_d.unsqueeze(1), partial + weighted[j], partial)
            entries = entries + on_d.long()
        if bf16_partials:
            rounded = partial.to(torch.bfloat16).float()
            partial = torch.where((entries > 1).unsqueeze(1), rounded, partial)
        acc = torch.where(first.unsqueeze(1), acc + partial, acc)
    return acc.to(torch.bfloat16)


def low_latency_combine(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: LowLatencyHandle,
    *,
    out: torch.Tensor | None = None,
    group: Group = None,
    mask: Sequence[int] | None = None,
    per_rank_partials: torch.dtype | None = None,
) -> torch.Tensor:
    """Low-latency combine: weighted sum of each token's expert outputs, in ``k`` order.

    Rank masking (``mask``, called by the live ranks only): entries on a masked rank are
    absent (skipped like ``-1``), and nothing goes back to a masked source, also when the rank
    was masked after the dispatch.

    ``out[t] = bf16(acc)`` where ``acc`` (float32) starts at +0.0 and, for ``k = 0 .. K-1``
    with ``topk_idx[t, k] >= 0``: ``acc = acc + topk_weights[t, k] * float32(y)``, ``y`` being
    the row of ``x`` in the slot that dispatch filled for ``(t, k)`` (every product rounded to
    float32, then added).

    With ``per_rank_partials`` the products are added per expert rank first, as the NVSHMEM
    kernels add them: for each rank ``d`` the token's entries reach, in the order its entries
    first reach them, a partial ``p_d`` (+0.0, then ``+ w * y`` of each entry on ``d`` in ``k``
    order), then ``out[t] = bf16(+0.0 + p_d1 + p_d2 + ...)``. ``torch.float32``: the kernels'
    default bits; ``torch.bfloat16``: ``p_d`` rounded to BF16 (to nearest even) where ``d``
    holds more than one of the token's entries, the bits of every transport with
    ``Options.low_latency_combine_bf16_partials``.

    Args:
        x: BF16 ``[E_loc, R*M, H]`` expert outputs in the dispatch layout (only the valid slots
            recorded in ``handle`` are read).
        topk_idx: int64 or int32 ``[T, K]``, the same as given to the dispatch on this rank.
        topk_weights: float32 ``[T, K]``.
        handle: the ``LowLatencyHandle`` of that dispatch.
        out: optional BF16 ``[T, H]`` to write the result into.
        group: process group (default: WORLD).
        mask: ranks masked (``ep_backend.low_latency_update_mask``), or None.
        per_rank_partials: None (``k`` order), ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        BF16 ``[T, H]`` (``out`` when given). Tokens without experts give 0.
    """
    assert per_rank_partials in (None, torch.float32, torch.bfloat16), (
        "per_rank_partials must be None, torch.float32 or torch.bfloat16"
    )
    num_ranks = _check_handle_group(handle, group)
    masked = _check_mask(mask, num_ranks, _group_size_and_rank(group)[1])
    experts_per_rank = handle.num_experts // num_ranks
    slots = num_ranks * handle.num_max_dispatch_tokens_per_rank
    hidden = handle.hidden
    assert x.dtype == torch.bfloat16, "x must be BF16"
    assert tuple(x.shape) == (experts_per_rank, slots, hidden), (
        f"x must be [{experts_per_rank}, {slots}, {hidden}], got {tuple(x.shape)}"
    )
    assert topk_weights.shape == topk_idx.shape, "topk_weights must match topk_idx"
    assert topk_weights.dtype == torch.float32, "topk_weights must be float32"
    num_tokens, num_topk = topk_idx.shape

    # Expert side: return every valid slot to its source rank; for each source rank, local
    # experts ascending, slots ascending: exactly the order in which that rank sent them.
    begin, count = _decode_layout_range(handle.layout_range)
    if masked:
        count = count.clone()
        count[:, masked] = 0
        topk_idx = _without_masked_ranks(topk_idx, masked, experts_per_rank)
    begin_list, count_list = begin.tolist(), count.tolist()
    back_rows = []
    for s in range(num_ranks):
        for le in range(experts_per_rank):
            b, n = begin_list[le][s], count_list[le][s]
            back_rows.append(x[le, b : b + n])
    send_back = torch.cat(back_rows)
    send_counts = count.sum(dim=0).tolist()

    # Token side: receive the rows in the order of this rank's dispatch entries.
    entry_token, entry_k, per_expert = _ll_send_plan(topk_idx, handle.num_experts)
    recv_counts = per_expert.reshape(num_ranks, experts_per_rank).sum(dim=1).tolist()
    if masked is not None:
        returned = _all_to_all_rows_among_live(send_back, send_counts, recv_counts, group, masked)
    else:
        returned = _all_to_all_rows(send_back, send_counts, recv_counts, group)

    y = torch.zeros((num_tokens, num_topk, hidden), dtype=torch.float32, device=x.device)
    y[entry_token, entry_k] = returned.float()
    if per_rank_partials is not None:
        result = _sum_of_rank_partials(
            topk_idx, topk_weights, y, experts_per_rank, per_rank_partials == torch.bfloat16
        )
    else:
        valid = topk_idx >= 0
        acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
        for k in range(num_topk):
            weighted = topk_weights[:, k].unsqueeze(1) * y[:, k]
            acc = torch.where(valid[:, k].unsqueeze(1), acc + weighted, acc)
        result = acc.to(torch.bfloat16)
    if out is not None:
        assert tuple(out.shape) == (num_tokens, hidden) and out.dtype == torch.bfloat16, (
            "out must be BF16 [T, H]"
        )
        out.copy_(result)
        return out
    return result


def all_to_all_v_2d(
    inputs: list[torch.Tensor], splits: list[torch.Tensor], num_local_experts: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The spec of ``ep_backend.all_to_all_v_2d`` (``num_local_experts=1``: ``all_to_all_v``),
    over every rank at once (no process group).

    Args:
        inputs: rank r's ``input`` ``[N_r, ...]``, one per rank, one dtype and row shape.
        splits: rank r's ``splits`` ``[R * E]`` int64: rows of ``inputs[r]`` for (destination d,
            local expert e) at index ``d * E + e``, in that order from row 0; valid (>= 0, summing
            to at most ``N_r``).
        num_local_experts: ``E``.

    Returns:
        Per rank d: ``(rows, recv_splits, recv_offsets)``: ``rows`` ``[total, ...]`` the received
        rows grouped by local expert, then by source rank; ``recv_splits`` ``[E, R]`` int64 rows
        of expert e from source s; ``recv_offsets`` ``[E, R]`` int64 their first row.
    """
    num_ranks, experts = len(inputs), num_local_experts
    chunks: list[list[torch.Tensor]] = []  # chunks[s][d * E + e]
    for s in range(num_ranks):
        sizes = [int(v) for v in splits[s].tolist()]
        used = sum(sizes)
        rest = inputs[s].shape[0] - used
        chunks.append(list(torch.split(inputs[s], [*sizes, rest]))[: num_ranks * experts])
    results = []
    for d in range(num_ranks):
        recv_splits = torch.tensor(
            [[int(splits[s][d * experts + e]) for s in range(num_ranks)] for e in range(experts)],
            dtype=torch.int64,
        ).view(experts, num_ranks)
        flat = recv_splits.reshape(-1)
        recv_offsets = (flat.cumsum(0) - flat).view(experts, num_ranks)
        pieces = [chunks[s][d * experts + e] for e in range(experts) for s in range(num_ranks)]
        rows = torch.cat(pieces) if pieces else inputs[d][:0]
        results.append((rows, recv_splits, recv_offsets))
    return results
