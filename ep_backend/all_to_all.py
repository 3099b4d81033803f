"""All-to-all with device-side split sizes: no host sync, CUDA-graph capturable on ep's kernels.

``dist.all_to_all_single`` needs its split sizes on the host, so a caller whose sizes come out of
a GPU computation (an MoE router) must copy them to the host first: a device-to-host sync per
call. These functions take the sizes as a device tensor instead; the receivers learn theirs from
the senders inside the kernel and return them as device tensors.

* ``all_to_all_v(input, splits)``: rank ``r`` sends rows ``[offset_d, offset_d + splits[d])`` of
  ``input`` to rank ``d`` (offsets: the exclusive prefix sum of ``splits``); the output holds the
  rows from rank 0, then rank 1, ... (what ``all_to_all_single`` with the same sizes returns).
* ``all_to_all_v_2d(input, splits, num_local_experts)``: ``input`` is chunked by (destination
  rank, local expert) in that order, ``splits`` ``[R * E]``; the output is grouped by local
  expert, then by source rank, which is what a grouped GEMM over local experts reads (the layout
  of ``torch.ops.symm_mem.all_to_all_vdev_2d``, without its alignment padding).

Where they run: CUDA tensors on a group whose all-to-all runs on ep's NVLink kernels
(``EPProcessGroup.all_to_all_transport == "nvlink"``) take one kernel launch and no host sync.
Elsewhere (CPU tensors through Gloo, CUDA tensors on an ``aten`` group through NCCL) the same
results come from an exchange of the sizes, a host sync and ``all_to_all_single``.

Errors: a rank whose splits are negative or exceed its input sends nothing, and a rank that would
receive more rows than its output holds writes nothing to it (never out of bounds); every other
rank's result is exact. On the kernels the error is recorded on the device and raised by the
next all-to-all or MoE call on the group, or by ``all_to_all_check`` (which synchronizes);
elsewhere it is raised at the end of the call, on the rank concerned.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._fallback import _check_fallback
from ._groups import Group, _backend_of, _group_info, get_backend
from ._streams import _run
from .errors import MoEInputError

__all__ = ["all_to_all_check", "all_to_all_v", "all_to_all_v_2d"]

# (output, recv_splits, recv_offsets), and the call's Work last with async_op=True.
AllToAllVResult = (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, dist.Work]
)


def all_to_all_v(
    input: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    capacity: int | None = None,
    group: Group = None,
    async_op: bool = False,
) -> AllToAllVResult:
    """All-to-all of the rows of ``input`` with split sizes on the device.

    Args:
        input: ``[N, ...]`` any dtype, on the group's device (CUDA) or CPU; made contiguous.
        splits: ``[R]`` int64 on ``input``'s device: rows for each destination rank, in order;
            they must be >= 0 and sum to at most ``N``.
        out: ``[C, ...]`` contiguous, ``input``'s dtype, device and row shape: receives the rows
            (rows past the received count are left as they were). ``None``: allocated with
            ``capacity`` rows.
        capacity: rows of the allocated output when ``out`` is None (default ``N * R``, enough
            when every rank sends at most ``N`` rows).
        group: an ``"ep"`` process group (default: WORLD).
        async_op: run on the backend's communication stream; a ``Work`` comes last in the result
            (its ``wait()`` makes the current stream wait).

    Returns:
        ``(output, recv_splits, recv_offsets)`` (plus ``work`` with ``async_op``): ``output``
        ``[C, ...]``; ``recv_splits`` ``[R]`` int64, rows received from each source rank;
        ``recv_offsets`` ``[R]`` int64, the first output row of each source's rows.

    Raises:
        TypeError / ValueError: on this rank, for arguments of the wrong type, dtype, shape or
            device (before anything is exchanged).
        MoEInputError: at the end of the call (Gloo / NCCL path) or later (kernels, see the
            module docstring) for invalid split values or a capacity overflow.
    """
    return _all_to_all(input, splits, out, capacity, 1, group, async_op, "all_to_all_v", flat=True)


def all_to_all_v_2d(
    input: torch.Tensor,
    splits: torch.Tensor,
    num_local_experts: int,
    out: torch.Tensor | None = None,
    *,
    capacity: int | None = None,
    group: Group = None,
    async_op: bool = False,
) -> AllToAllVResult:
    """All-to-all of rows chunked by (destination rank, local expert), output grouped by expert.

    Args:
        input: ``[N, ...]``: the rows for rank 0's expert 0, rank 0's expert 1, ..., rank 1's
            expert 0, ... (``splits`` gives each chunk's rows).
        splits: ``[R * E]`` int64 on ``input``'s device, ``E = num_local_experts`` (the
            destination's local expert ``e`` is global expert ``d * E + e``).
        num_local_experts: ``E``, the same on every rank, in ``[1, 256]``.
        out, capacity, group, async_op: as for ``all_to_all_v``.

    Returns:
        ``(output, recv_splits, recv_offsets)`` (plus ``work``): ``output`` holds local expert
        0's rows (from source rank 0, then 1, ...), then expert 1's, ...; ``recv_splits``
        ``[E, R]`` int64, rows of local expert ``e`` from source ``s``; ``recv_offsets``
        ``[E, R]`` int64, their first output row. Rows per expert: ``recv_splits.sum(1)``.

    Raises:
        as ``all_to_all_v``.
    """
    if not isinstance(num_local_experts, int) or isinstance(num_local_experts, bool):
        raise TypeError(f"num_local_experts must be an int, got {type(num_local_experts).__name__}")
    if not 1 <= num_local_experts <= 256:
        raise ValueError(f"num_local_experts must be in [1, 256], got {num_local_experts}")
    op = "all_to_all_v_2d"
    return _all_to_all(
        input, splits, out, capacity, num_local_experts, group, async_op, op, flat=False
    )


def all_to_all_check(group: Group = None) -> None:
    """Synchronizes the current CUDA stream and raises the error of an earlier all-to-all kernel.

    The device-split kernels record a capacity overflow or invalid splits on the device rather
    than syncing; the next all-to-all or MoE call raises it, or this function, now.

    Raises:
        MoEInputError: naming the op, the rank and the sizes.
    """
    backend = get_backend(group)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    error = backend._take_all_to_all_error()
    if error:
        raise MoEInputError(error)


def _check_args(
    input: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor | None,
    capacity: int | None,
    num_local_experts: int,
    num_ranks: int,
    op: str,
) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{op}: input must be a tensor, got {type(input).__name__}")
    if not isinstance(splits, torch.Tensor):
        raise TypeError(f"{op}: splits must be a tensor, got {type(splits).__name__}")
    if input.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension (rows)")
    if splits.dtype != torch.int64:
        raise TypeError(f"{op}: splits must be int64, got {splits.dtype}")
    if splits.shape != (num_ranks * num_local_experts,):
        raise ValueError(
            f"{op}: splits must have shape [{num_ranks * num_local_experts}] "
            f"(ranks x local experts), got {list(splits.shape)}"
        )
    if splits.device != input.device:
        raise ValueError(f"{op}: splits is on {splits.device}, input on {input.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{op}: out must be a tensor, got {type(out).__name__}")
        if capacity is not None:
            raise ValueError(f"{op}: pass out or capacity, not both")
        if out.dtype != input.dtype or out.device != input.device:
            raise ValueError(
                f"{op}: out must match input's dtype and device ({input.dtype}, {input.device}),"
                f" got {out.dtype}, {out.device}"
            )
        if out.dim() != input.dim() or out.shape[1:] != input.shape[1:]:
            raise ValueError(
                f"{op}: out's rows must have input's shape {list(input.shape[1:])}, "
                f"got {list(out.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{op}: out must be contiguous")
    elif capacity is not None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"{op}: capacity must be an int >= 0, got {capacity!r}")


def _all_to_all(
    input: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor | None,
    capacity: int | None,
    num_local_experts: int,
    group: Group,
    async_op: bool,
    op: str,
    *,
    flat: bool,
) -> AllToAllVResult:
    """all_to_all_v (``flat``: receive splits and offsets ``[R]``) and all_to_all_v_2d (``[E, R]``).

    On ep's kernels the receive splits and offsets come from the backend in one allocation; this
    layer is on the host path of every call, so it reads the group's size and backend once
    (``_GroupInfo``).
    """
    pg, info = _group_info(group)
    num_ranks = info.size
    _check_args(input, splits, out, capacity, num_local_experts, num_ranks, op)
    x = input.contiguous()
    if out is None:
        rows = capacity if capacity is not None else x.shape[0] * num_ranks
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    backend = _backend_of(pg, info)
    on_cuda = x.device.type == "cuda"
    output = out

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if on_cuda:
            received = backend._all_to_all_v(x, splits, output, num_local_experts, flat)
            if received is not None:
                return output, received[0], received[1]
        recv_splits = torch.empty(
            (num_local_experts, num_ranks), dtype=torch.int64, device=x.device
        )
        recv_offsets = torch.empty_like(recv_splits)
        _exchange(x, splits, output, num_local_experts, recv_splits, recv_offsets, pg, op)
        if flat:
            return output, recv_splits.view(-1), recv_offsets.view(-1)
        return output, recv_splits, recv_offsets

    result, work = _run(run, [x, splits, out], x.device, async_op, lambda r: list(r))
    _check_fallback(pg, info.pending, "all_to_all", on_cuda)
    if not async_op:
        return result
    assert work is not None  # _run makes one for async_op
    return (*result, work)


def _exchange(
    x: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor,
    num_local_experts: int,
    recv_splits: torch.Tensor,
    recv_offsets: torch.Tensor,
    pg: dist.ProcessGroup,
    op: str,
) -> None:
    """The device-split all-to-all over the inner backend: sizes first (a host sync), then rows.

    The same results and error rules as the kernels: a rank with invalid splits sends nothing,
    a rank whose output is too small writes nothing, and each raises at the end.
    """
    num_ranks, experts = pg.size(), num_local_experts
    counts = splits.view(num_ranks, experts)
    negative = bool((counts < 0).any())
    total_send = int(counts.clamp(min=0).sum())
    valid = not negative and total_send <= x.shape[0]
    if not valid:
        counts = torch.zeros_like(counts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=pg)  # [s, e] from s for my e
    send_rows = counts.sum(1).tolist()
    recv_rows = received.sum(1).tolist()
    rows_in = sum(send_rows)
    staged = torch.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(
        staged,
        x[:rows_in],
        output_split_sizes=recv_rows,
        input_split_sizes=send_rows,
        group=pg,
    )
    per_expert = received.t().contiguous()  # [e, s]
    offsets = per_expert.reshape(-1).cumsum(0) - per_expert.reshape(-1)
    recv_splits.copy_(per_expert)
    recv_offsets.copy_(offsets.view(experts, num_ranks))
    total = int(per_expert.sum())
    overflow = total > out.shape[0]
    if not overflow:
        cuts = received.reshape(-1).tolist()  # the staged rows: source-major, then expert
        starts = offsets.view(experts, num_ranks).tolist()
        at = 0
        for s in range(num_ranks):
            for e in range(experts):
                n = cuts[s * experts + e]
                if n:
                    out[starts[e][s] : starts[e][s] + n].copy_(staged[at : at + n])
                at += n
    if not valid:
        what = (
            "got a negative split"
            if negative
            else f"was asked to send {total_send} rows (the sum of its splits), more than its "
            f"input's {x.shape[0]} rows"
        )
        raise MoEInputError(f"ep {op}: rank {pg.rank()} {what}; nothing was sent")
    if overflow:
        raise MoEInputError(
            f"ep {op}: rank {pg.rank()} would receive {total} rows, more than the output's "
            f"capacity of {out.shape[0]} rows (nothing was written to the output)"
        )
