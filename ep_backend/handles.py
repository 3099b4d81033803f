"""Typed results and handles of the MoE collectives.

These dataclasses are shared by the executable spec (``ep_backend.reference``) and by the
real implementations, so both return exactly the same structure. Shapes use the notation of
``docs/semantics.md``: ``T`` tokens on this rank, ``H`` hidden size, ``K`` top-k, ``E`` experts,
``R`` ranks, ``E_loc = E // R`` experts per rank, ``N`` received rows (or the fixed capacity
``num_worst_tokens`` when that is set), ``M`` = ``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class DispatchLayout:
    """Result of ``get_dispatch_layout``.

    Attributes:
        num_tokens_per_rank: int32 ``[R]``; tokens this rank sends to each rank (a token counts
            once per rank however many of its experts live there).
        num_tokens_per_expert: int32 ``[E]``; (token, expert) selections per global expert.
        is_token_in_rank: bool ``[T, R]``; whether token ``t`` is sent to rank ``r``.
        send_pos: int32 ``[T, R]``; position of token ``t`` among this rank's tokens sent to rank
            ``r`` (the row's slot in what ``r`` receives from us), ``-1`` where it is not sent.

        num_tokens_per_node: int32 ``[num_nodes]`` (a property, computed from
            ``is_token_in_rank`` at first read, so a caller that never reads it pays nothing):
            tokens with at least one expert on a rank of each node, DeepEP's
            ``num_tokens_per_rdma_rank`` (``reference.tokens_per_node``). Not available on a
            layout made under ``torch.compile`` (raises).
        work: the ``Work`` of an ``async_op=True`` call (``None`` otherwise): wait on it before
            the current stream reads these tensors (a dispatch with ``async_op=True`` runs on the
            same communication stream, after them, and need not wait).

    Passing the layout to ``dispatch(..., layout=...)`` skips computing it again there, as
    DeepEP's dispatch takes ``get_dispatch_layout``'s results. Iterating yields the first three
    fields (DeepEP's order).
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_pos: torch.Tensor | None = None
    work: dist.Work | None = field(default=None, compare=False)
    # What it was computed from and what it returned: (weak reference to topk_idx, its version,
    # num_experts, R, weak references to the four tensors, their versions), so dispatch can
    # refuse a layout of another (or since modified) topk_idx, or one whose tensors were replaced
    # or modified.
    _source: tuple | None = field(default=None, repr=False, compare=False)
    # The group's node of each rank (``ep_backend.topology``); None: one node.
    _node_of_rank: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _per_node: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens_per_node(self) -> torch.Tensor:
        """int32 ``[num_nodes]``: tokens sent to at least one rank of each node."""
        if self._per_node is None:
            from .reference import tokens_per_node

            if self._node_of_rank is None:
                raise RuntimeError(
                    "ep: this layout was made under torch.compile, which does not record the "
                    "group's nodes; use reference.tokens_per_node(layout.is_token_in_rank, "
                    "ep_backend.topology(group).node_of_rank)"
                )
            self._per_node = tokens_per_node(self.is_token_in_rank, self._node_of_rank)
        return self._per_node

    def __iter__(self):  # allows ``a, b, c = layout``
        return iter((self.num_tokens_per_rank, self.num_tokens_per_expert, self.is_token_in_rank))


@dataclass
class DispatchHandle:
    """Routing of one high-throughput dispatch; what combine and cached dispatch need.

    Attributes:
        num_ranks: ``R``.
        num_experts: ``E``.
        is_token_in_rank: bool ``[T, R]``; send map of this rank's tokens.
        num_tokens_per_rank: int32 ``[R]``; rows this rank sent to each rank.
        num_recv_tokens_per_rank: int32 ``[R]``; rows received from each source rank.
        recv_src_idx: int32 ``[N]``; source token index of every received row, ``-1`` on padding.
        recv_src_rank: int32 ``[N]``; source rank of every received row, ``-1`` on padding.
        num_worst_tokens: fixed receive capacity, ``0`` when outputs are exactly sized.
        group_name: the process group the dispatch ran on (``None`` for the reference's
            handles): combine and cached dispatch refuse a handle of another group, which
            includes a group aborted and re-created since (a new group has a new name).
    """

    num_ranks: int
    num_experts: int
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_src_rank: torch.Tensor
    num_worst_tokens: int = 0
    group_name: str | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        """``T``: tokens on this rank when the handle was made."""
        return int(self.is_token_in_rank.shape[0])

    @property
    def num_recv_rows(self) -> int:
        """Rows of the received tensors (``N``: exact count, or the fixed capacity)."""
        return int(self.recv_src_idx.shape[0])


@dataclass
class DispatchOutput:
    """Result of a high-throughput dispatch.

    Attributes:
        recv_x: ``[N, H]`` received rows, same dtype as ``x`` (BF16, FP8 e4m3, or float32/64);
            ordered by source rank, then by source token index. With ``num_worst_tokens`` the rows
            past the valid count are padding (contents unspecified).
        recv_x_scales: ``[N, S]`` scales passed through untouched (FP8 input), else ``None``.
        recv_topk_idx: ``[N, K]`` *local* expert ids (``-1`` for experts on other ranks and on
            padding), dtype of the input ``topk_idx``; ``None`` for a cached dispatch.
        recv_topk_weights: float32 ``[N, K]``, ``0`` where ``recv_topk_idx`` is ``-1``; ``None``
            when no weights were given or for a cached dispatch.
        num_recv_tokens_per_expert: int32 ``[E_loc]`` on the device of ``x``: rows per local
            expert, each rounded up to ``expert_alignment``; ``None`` for a cached dispatch.
        handle: the routing, for ``combine`` and cached dispatch.
        num_recv_tokens_per_expert_list: the same as a Python list, known on the host before
            the data moves (so also with ``async_op=True``); empty with ``num_worst_tokens`` > 0
            (no host step) and for a cached dispatch.
        work: the ``Work`` of an ``async_op=True`` call (``None`` otherwise); wait on it before
            using the tensors.
    """

    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: torch.Tensor | None
    handle: DispatchHandle
    num_recv_tokens_per_expert_list: list[int] = field(default_factory=list)
    work: dist.Work | None = None


@dataclass
class CombineOutput:
    """Result of a high-throughput combine.

    Attributes:
        combined_x: ``[T, H]`` in the dtype of the combined ``x``.
        combined_topk_weights: float32 ``[T, K]`` (sum of the returned weights) or ``None``.
        work: the ``Work`` of an ``async_op=True`` call, else ``None``.
    """

    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor | None = None
    work: dist.Work | None = None

    def __iter__(self):  # allows ``x, w = combine(...)``
        return iter((self.combined_x, self.combined_topk_weights))


@dataclass
class LowLatencyHandle:
    """Routing of one low-latency dispatch.

    Attributes:
        src_info: int32 ``[E_loc, R*M]``; source token index of every valid slot (``-1`` past
            ``recv_count``).
        layout_range: int64 ``[E_loc, R]``; ``(begin << 32) | count`` of each source rank's rows
            inside the expert's slots.
        num_max_dispatch_tokens_per_rank: ``M``.
        hidden: ``H``.
        num_experts: ``E``.
        num_ranks: ``R``.
        buffer_index: ``0``. Kept for the reference's layout; the NVSHMEM kernels track the
            buffer of each dispatch themselves (by the identity of ``layout_range``), so this
            field says nothing about it.
        group_name: the process group the dispatch ran on (``None`` for the reference's
            handles): ``low_latency_combine`` refuses a handle of another group.
    """

    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_ranks: int
    buffer_index: int = 0
    group_name: str | None = field(default=None, compare=False)


@dataclass
class LowLatencyDispatchOutput:
    """Result of a low-latency dispatch.

    Attributes:
        recv_x: ``[E_loc, R*M, H]`` BF16, or FP8 e4m3 when ``use_fp8``; only the first
            ``recv_count[e]`` rows of expert ``e`` are valid. Rows of one expert are ordered by
            source rank, then source token index.
        recv_x_scales: with ``use_fp8``: float32 ``[E_loc, R*M, H/128]``, or int32
            ``[E_loc, R*M, H/512]`` (four UE8M0 exponents per int32) with ``use_ue8m0``; else None.
        recv_count: int32 ``[E_loc]`` valid rows per local expert.
        handle: the routing, for ``low_latency_combine``.
        hook: with ``return_recv_hook=True``, a callable that completes the receive; else None.
        work: the ``Work`` of an ``async_op=True`` call, else ``None``.
    """

    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_count: torch.Tensor
    handle: LowLatencyHandle
    hook: Callable[[], None] | None = None
    work: dist.Work | None = None
