"""DeepEP-shaped handles over ``ep``'s handles, indexable as DeepEP's tuples.

Callers keep a handle between dispatch and combine and sometimes read it by position (DeepEP's
own tests read ``handle[0]``), so the facade's handles index, iterate and unpack like DeepEP's
tuples. Each also carries the ``ep`` handle the facade passes back to ``ep``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import ep_backend

__all__ = ["IntranodeHandle", "LowLatencyHandle", "Unavailable"]


class Unavailable:
    """A handle field ``ep`` has no equivalent for: indexing gives it, any use raises.

    Args:
        name: DeepEP's name of the field.
        why: what ``ep`` lacks.
    """

    __slots__ = ("_name", "_why")

    def __init__(self, name: str, why: str) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_why", why)

    def _fail(self) -> NotImplementedError:
        return NotImplementedError(
            f"deep_ep (ep): handle field {self._name!r} has no equivalent in ep: {self._why}"
        )

    def __getattr__(self, attr: str) -> Any:
        raise self._fail()

    def __getitem__(self, key: Any) -> Any:
        raise self._fail()

    def __len__(self) -> int:
        raise self._fail()

    def __iter__(self) -> Iterator[Any]:
        raise self._fail()

    def __bool__(self) -> bool:
        raise self._fail()

    def __repr__(self) -> str:
        return f"<deep_ep (ep): {self._name} unavailable: {self._why}>"


_NO_CHANNELS = "ep's kernels do not split tokens into DeepEP's channels (num_sms / 2 queues)"


class IntranodeHandle:
    """DeepEP's intranode dispatch handle, over an ``ep_backend.DispatchHandle``.

    Position ``i`` gives DeepEP's field ``i``:

    0. ``rank_prefix_matrix`` int32 ``[R, R]``: entry ``[i][j]`` is the rows rank ``j``
       received from ranks ``0..i``. This rank knows its own column (``j == rank``: the end of
       each source rank's segment of ``recv_x``, what DeepEP's tests read); the other columns
       would need a collective and hold ``-1``.
    1. ``channel_prefix_matrix``: ``Unavailable`` (ep has no channels).
    2. ``recv_channel_prefix_matrix``: ``Unavailable``.
    3. ``recv_src_idx`` int32 ``[N]``: source token index of each received row.
    4. ``is_token_in_rank`` bool ``[T, R]``.
    5. ``send_head`` int32 ``[T, R]``: token ``t``'s position among this rank's rows sent to
       rank ``r`` (``-1`` where not sent); ep's equivalent of DeepEP's queue slot.

    Fields 0 and 5 are computed on first access (a few tensor ops), not on every dispatch.

    Attributes:
        ep_handle: the ``ep_backend.DispatchHandle`` ``combine`` and cached dispatch use.
        rank: this rank in the group.
    """

    __slots__ = ("_fields", "ep_handle", "rank")
    NUM_FIELDS = 6

    def __init__(self, ep_handle: ep_backend.DispatchHandle, rank: int) -> None:
        self.ep_handle = ep_handle
        self.rank = rank
        self._fields: list[Any] = [None] * self.NUM_FIELDS

    def _field(self, index: int) -> Any:
        value = self._fields[index]
        if value is None:
            value = self._fields[index] = self._compute(index)
        return value

    def _compute(self, index: int) -> Any:
        h = self.ep_handle
        if index == 0:
            column = torch.cumsum(h.num_recv_tokens_per_rank.to(torch.int64), 0).to(torch.int32)
            matrix = torch.full(
                (h.num_ranks, h.num_ranks), -1, dtype=torch.int32, device=column.device
            )
            matrix[:, self.rank] = column
            return matrix
        if index == 1:
            return Unavailable("channel_prefix_matrix", _NO_CHANNELS)
        if index == 2:
            return Unavailable("recv_channel_prefix_matrix", _NO_CHANNELS)
        if index == 3:
            return h.recv_src_idx
        if index == 4:
            return h.is_token_in_rank
        in_rank = h.is_token_in_rank
        position = torch.cumsum(in_rank.to(torch.int32), 0, dtype=torch.int32) - 1
        return torch.where(in_rank, position, torch.full_like(position, -1))

    def __len__(self) -> int:
        return self.NUM_FIELDS

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return tuple(self._field(i) for i in range(self.NUM_FIELDS)[key])
        index = key.__index__()
        if index < 0:
            index += self.NUM_FIELDS
        if not 0 <= index < self.NUM_FIELDS:
            raise IndexError(f"handle index {key} out of range (DeepEP's handle has 6 fields)")
        return self._field(index)

    def __iter__(self) -> Iterator[Any]:
        return (self._field(i) for i in range(self.NUM_FIELDS))

    def __repr__(self) -> str:
        h = self.ep_handle
        return f"deep_ep.IntranodeHandle(ranks={h.num_ranks}, tokens={h.num_tokens}, rows={h.num_recv_rows})"


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle ``(src_info, layout_range, M, hidden, num_experts)``.

    A real tuple (every field exists in ``ep``): ``src_info`` int32 ``[E_loc, R*M]``,
    ``layout_range`` int64 ``[E_loc, R]`` packed ``begin << 32 | count``, then the three ints.

    Attributes:
        ep_handle: the ``ep_backend.LowLatencyHandle`` ``low_latency_combine`` uses.
        combine_buffer: the tensor ``get_next_low_latency_combine_buffer`` gave for this
            handle (for ``zero_copy`` combines), else ``None``.
    """

    ep_handle: ep_backend.LowLatencyHandle
    combine_buffer: torch.Tensor | None

    def __new__(cls, ep_handle: ep_backend.LowLatencyHandle) -> LowLatencyHandle:
        self = super().__new__(
            cls,
            (
                ep_handle.src_info,
                ep_handle.layout_range,
                ep_handle.num_max_dispatch_tokens_per_rank,
                ep_handle.hidden,
                ep_handle.num_experts,
            ),
        )
        self.ep_handle = ep_handle
        self.combine_buffer = None
        return self
