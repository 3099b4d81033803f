"""DeepEP's ``Config``: the SM budget of the high-throughput kernels, plus queue sizes.

DeepEP V1 moves tokens through per-(channel, peer) ring buffers whose sizes these fields set.
``ep`` has no such queues: it sizes its transport from the shapes it sees
(``ep_backend.reserve``). Of a ``Config`` the facade honours ``num_sms`` (the blocks of ep's
dispatch and combine kernels, ``ep_backend.Options.num_sms``); the chunk sizes are validated as
DeepEP does and only feed the buffer-size hints, which callers pass back to ``Buffer`` and which
``ep`` does not need.
"""

from __future__ import annotations

__all__ = ["Config"]

# Upper bounds DeepEP's size hints assume per row: top-k entries and FP8 scales.
_HINT_MAX_TOPK = 128
_HINT_MAX_SCALES = 128
_NVL_PEERS_PER_NODE = 8


def _require_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    return value


class Config:
    """Tuning of a high-throughput dispatch or combine (DeepEP V1's ``Config``).

    Args:
        num_sms: SMs (blocks) of ep's dispatch and combine kernels; DeepEP requires it even.
        num_max_nvl_chunked_send_tokens: DeepEP queue chunk (validated, used by size hints only).
        num_max_nvl_chunked_recv_tokens: DeepEP queue depth (validated, size hints only).
        num_max_rdma_chunked_send_tokens: as above, internode.
        num_max_rdma_chunked_recv_tokens: as above, internode (rounded up to a multiple of
            the send chunk, as DeepEP does).

    Raises:
        TypeError: a field that is not a positive int.
        ValueError: ``num_sms`` odd, or chunk sizes DeepEP rejects (send chunk not below the
            receive depth; RDMA send chunk above half the RDMA depth).
    """

    __slots__ = (
        "num_max_nvl_chunked_recv_tokens",
        "num_max_nvl_chunked_send_tokens",
        "num_max_rdma_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens",
        "num_sms",
    )

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        self.num_sms = _require_positive_int(num_sms, "num_sms")
        nvl_send = _require_positive_int(
            num_max_nvl_chunked_send_tokens, "num_max_nvl_chunked_send_tokens"
        )
        nvl_recv = _require_positive_int(
            num_max_nvl_chunked_recv_tokens, "num_max_nvl_chunked_recv_tokens"
        )
        rdma_send = _require_positive_int(
            num_max_rdma_chunked_send_tokens, "num_max_rdma_chunked_send_tokens"
        )
        rdma_recv = _require_positive_int(
            num_max_rdma_chunked_recv_tokens, "num_max_rdma_chunked_recv_tokens"
        )
        if num_sms % 2 != 0:
            raise ValueError(
                f"num_sms must be even (DeepEP uses num_sms / 2 channels), got {num_sms}"
            )
        if nvl_send >= nvl_recv:
            raise ValueError(
                f"num_max_nvl_chunked_send_tokens ({nvl_send}) must be below "
                f"num_max_nvl_chunked_recv_tokens ({nvl_recv})"
            )
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        if rdma_send > rdma_recv // 2:
            raise ValueError(
                f"num_max_rdma_chunked_send_tokens ({rdma_send}) must be at most half of "
                f"num_max_rdma_chunked_recv_tokens ({rdma_recv})"
            )
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def _row_bytes(self, hidden_bytes: int) -> int:
        """Bytes of one queued token: the row, its top-k ids (int64) and weights, its scales."""
        return hidden_bytes + _HINT_MAX_TOPK * (8 + 4) + _HINT_MAX_SCALES * 4

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP's NVLink queues of this config would take (128-byte aligned).

        ``ep`` sizes its own buffers; the number only lets caller code that sizes a
        ``Buffer`` (``Buffer(group, num_nvl_bytes, ...)``) run unchanged.
        """
        _require_positive_int(hidden_bytes, "hidden_bytes")
        _require_positive_int(num_ranks, "num_ranks")
        peers = min(num_ranks, _NVL_PEERS_PER_NODE)
        channels = self.num_sms // 2
        total = (
            channels * peers * self.num_max_nvl_chunked_recv_tokens * self._row_bytes(hidden_bytes)
        )
        return -(-total // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP's RDMA queues would take: 0 within one node (at most 8 ranks)."""
        _require_positive_int(hidden_bytes, "hidden_bytes")
        _require_positive_int(num_ranks, "num_ranks")
        if num_ranks <= _NVL_PEERS_PER_NODE:
            return 0
        nodes = -(-num_ranks // _NVL_PEERS_PER_NODE)
        channels = self.num_sms // 2
        total = (
            2
            * channels
            * nodes
            * self.num_max_rdma_chunked_recv_tokens
            * self._row_bytes(hidden_bytes)
        )
        return -(-total // 128) * 128

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, "
            f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
            f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
            f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
            f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})"
        )
