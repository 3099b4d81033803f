"""Bytes the low-latency (NVSHMEM) kernels put on the link, for the bench's "ll bound" rows.

``python -m ep_backend.bench`` reads each low-latency op against the push limit of the same run:
the bytes that op moves over the busiest GPU's links at that rate give the least time the link
allows. The bytes are those of the kernels in ``native/transports/nvshmem/cuda/`` (their header
comments describe the protocol; the sizes come from ``nvshmem_common.hpp``), on the P2P path
(every peer mapped: one host), expert ``e`` on rank ``e // (E / R)`` (``ep_backend/reference.py``):

- **dispatch** (``nvshmem_dispatch.cu``): one message per (token, destination RANK holding at
  least one of its top-k experts), not per expert: a header (source token, entry count, then
  (key, position) per entry, sized for the runtime's largest top-k and stored whole), then the
  row: BF16 ``2H`` bytes, or FP8 ``H`` bytes + ``H / 128`` float32 scales, padded to 16 bytes.
  Signals, one u64 store each, to every peer: the token count, a row count per expert of that
  peer, and a message flag per token ("message" or "no message").
- **combine** (``nvshmem_combine.cu``): step 0, every rank sends its ``T * K`` weights to every
  peer as tagged u64 words, then a weights flag; then each expert rank returns ONE partial per
  (token, expert rank): float32 ``[H]`` (``4H`` bytes) when the token had more than one entry
  there, else the BF16 row (``2H``), each followed by its u64 flag. With
  ``Options.low_latency_combine_bf16_partials`` every partial is BF16 (``2H``).

Only messages to other ranks leave a GPU. What rank ``s``'s tokens cause is known from its own
``topk_idx`` (:func:`ll_wire_bytes`); what one GPU sends in a combine (the partials it returns)
and receives in a dispatch depends on its peers' routing, so :func:`ll_link_bytes` puts every
rank's share together. Capacity overflow (an expert receiving more than ``M`` rows from one
source, which only repeated expert ids can cause since ``T <= M``) is not modelled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# nvshmem_common.hpp, header_bytes(max_topk): 8 bytes (source token, entry count) + 8 per entry
# slot (header_key, position p) of the runtime's largest top-k, rounded up to 16; send_headers in
# nvshmem_dispatch.cu stores the whole header of every message.
HEADER_FIXED_BYTES = 8
HEADER_ENTRY_BYTES = 8
# nvshmem_common.hpp, Message::make: header + (payload + scales) rounded up to 16 bytes.
MESSAGE_ALIGN = 16
BF16_BYTES = 2  # the BF16 payload: 2 bytes per channel
FP8_BYTES = 1  # the FP8 payload: 1 byte per channel
GROUP_SIZE = 128  # kGroupSize (nvshmem_common.hpp): FP8 channels per scale
SCALE_BYTES = 4  # one float32 scale per group (UE8M0 packing, which the bench does not use, is 1)
# Every signal and flag is one u64 store (nvshmem_common.hpp, BufferLayout's comment): dispatch
# disp_tokens (one per peer), disp_count (one per expert of the peer), disp_flag (one per token
# and peer); combine comb_wflag (one per peer), comb_flag (one per partial).
SIGNAL_BYTES = 8
# Combine step 0 (send_weights in nvshmem_combine.cu): weight_word, u64 weight_tag << 32 |
# float32 bits, for each of the T * K entries (-1 ones included), to every peer.
WEIGHT_WORD_BYTES = 8
# Combine partials (send_phase in nvshmem_combine.cu): float32 per channel when the token had
# more than one entry on the expert rank, else the BF16 row itself.
PARTIAL_SUM_BYTES = 4
PARTIAL_ROW_BYTES = 2


def header_bytes(max_topk: int) -> int:
    """Bytes of a dispatch message header for a runtime whose largest top-k is ``max_topk``."""
    raw = HEADER_FIXED_BYTES + HEADER_ENTRY_BYTES * max_topk
    return -(-raw // MESSAGE_ALIGN) * MESSAGE_ALIGN


def message_bytes(hidden: int, fp8: bool, max_topk: int) -> int:
    """Bytes of one dispatch message (header + row + scales) of ``hidden`` channels."""
    body = hidden * FP8_BYTES + hidden // GROUP_SIZE * SCALE_BYTES if fp8 else hidden * BF16_BYTES
    return header_bytes(max_topk) + -(-body // MESSAGE_ALIGN) * MESSAGE_ALIGN


@dataclass(frozen=True)
class LLWire:
    """What one rank's tokens put on the link in one call of each LL op, per peer.

    Index ``d`` of each tuple is rank ``d`` (0 at ``d == rank``: local bytes never leave the GPU).
    ``dispatch_fp8`` / ``dispatch_bf16``: bytes this rank sends to ``d`` in one dispatch.
    ``combine_weights``: bytes this rank sends to ``d`` in step 0 of one combine.
    ``combine_partials``: bytes ``d`` returns to this rank in one combine (partials and flags).
    """

    rank: int
    dispatch_fp8: tuple[int, ...]
    dispatch_bf16: tuple[int, ...]
    combine_weights: tuple[int, ...]
    combine_partials: tuple[int, ...]

    @property
    def dispatch_fp8_sent(self) -> int:
        """Bytes leaving this rank's GPU in one FP8 dispatch."""
        return sum(self.dispatch_fp8)

    @property
    def dispatch_bf16_sent(self) -> int:
        """Bytes leaving this rank's GPU in one BF16 dispatch."""
        return sum(self.dispatch_bf16)

    @property
    def combine_partials_received(self) -> int:
        """Partial bytes (and their flags) the peers return to this rank in one combine; the
        peers' weights come on top (:func:`ll_link_bytes`)."""
        return sum(self.combine_partials)

    def as_tensor(self) -> torch.Tensor:
        """int64 ``[4, R]``: the four tuples as rows (for a collective; :meth:`from_tensor`)."""
        return torch.tensor(
            [self.dispatch_fp8, self.dispatch_bf16, self.combine_weights, self.combine_partials],
            dtype=torch.int64,
        )

    @staticmethod
    def from_tensor(rank: int, table: torch.Tensor) -> LLWire:
        """The inverse of :meth:`as_tensor`."""
        rows = [tuple(int(v) for v in row) for row in table.tolist()]
        return LLWire(rank, rows[0], rows[1], rows[2], rows[3])


def ll_wire_bytes(
    topk_idx: torch.Tensor,
    num_experts: int,
    world: int,
    rank: int,
    hidden: int,
    max_topk: int | None = None,
    bf16_partials: bool = False,
) -> LLWire:
    """Bytes this rank's tokens put on the link, per peer, in one LL dispatch (FP8 and BF16) and
    one BF16 combine.

    ``topk_idx``: this rank's int ``[T, K]`` routing, ``-1`` = no expert. ``max_topk``: the
    largest top-k of the runtime (its message header size); default ``K`` (the runtime takes the
    largest ``K`` of the ranks' calls, the bench's ``K`` on every rank). ``bf16_partials``: the
    combine of ``Options.low_latency_combine_bf16_partials`` (a sum goes back as BF16). The bytes
    leaving this GPU in a dispatch are ``dispatch_fp8_sent`` / ``dispatch_bf16_sent``; those of a
    combine and those entering it need every rank's share: :func:`ll_link_bytes`.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected [T, K], got shape {tuple(topk_idx.shape)}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}: expected 0 <= rank < world")
    if num_experts < world or num_experts % world:
        raise ValueError(f"num_experts {num_experts}: must be a multiple of world {world}")
    if hidden < GROUP_SIZE or hidden % GROUP_SIZE:
        raise ValueError(f"hidden {hidden}: must be a positive multiple of {GROUP_SIZE}")
    num_tokens, topk = topk_idx.shape
    max_topk = topk if max_topk is None else max_topk
    if max_topk < max(topk, 1):
        raise ValueError(f"max_topk {max_topk}: must be at least K = {topk} and 1")
    idx = topk_idx.detach().to("cpu", torch.int64)
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ValueError(f"topk_idx: values must be in [-1, {num_experts})")
    experts_per_rank = num_experts // world
    # Entries per (token, rank); column `world` collects the -1 entries.
    dest = torch.where(idx >= 0, idx // experts_per_rank, world)
    per_rank = torch.zeros(num_tokens, world + 1, dtype=torch.int64)
    per_rank.scatter_add_(1, dest, torch.ones_like(dest))
    per_rank = per_rank[:, :world]
    messages = (per_rank > 0).sum(0).tolist()  # tokens reaching rank d: one message each
    sums = (per_rank > 1).sum(0).tolist()  # of them, float32 partials on the way back
    rows = (per_rank == 1).sum(0).tolist()  # and BF16 rows
    signals = SIGNAL_BYTES * (1 + experts_per_rank + num_tokens)  # token count, row counts, flags
    weights = WEIGHT_WORD_BYTES * num_tokens * topk + SIGNAL_BYTES  # the words, the weights flag
    sum_bytes = PARTIAL_ROW_BYTES if bf16_partials else PARTIAL_SUM_BYTES
    partial_sum = sum_bytes * hidden + SIGNAL_BYTES
    partial_row = PARTIAL_ROW_BYTES * hidden + SIGNAL_BYTES
    fp8, bf16 = message_bytes(hidden, True, max_topk), message_bytes(hidden, False, max_topk)
    remote = [d != rank for d in range(world)]
    return LLWire(
        rank,
        tuple(messages[d] * fp8 + signals if remote[d] else 0 for d in range(world)),
        tuple(messages[d] * bf16 + signals if remote[d] else 0 for d in range(world)),
        tuple(weights if remote[d] else 0 for d in range(world)),
        tuple(
            sums[d] * partial_sum + rows[d] * partial_row if remote[d] else 0 for d in range(world)
        ),
    )


@dataclass(frozen=True)
class LinkLoad:
    """One op's bytes per GPU (index = rank): ``sent`` leave it, ``received`` arrive at it."""

    sent: tuple[int, ...]
    received: tuple[int, ...]

    @property
    def bound_bytes(self) -> int:
        """The most bytes one GPU moves in one direction: at a per-direction link limit, the
        slowest GPU's share bounds the op."""
        return max(max(self.sent, default=0), max(self.received, default=0))

    @property
    def busiest(self) -> str:
        """Which GPU and direction carry :attr:`bound_bytes` (the first in rank order, sending
        before receiving), e.g. ``"rank 2 receiving"``."""
        for r, (out, into) in enumerate(zip(self.sent, self.received, strict=True)):
            if out == self.bound_bytes:
                return f"rank {r} sending"
            if into == self.bound_bytes:
                return f"rank {r} receiving"
        return "no rank"


# One rank's bytes per peer of one op (a field of LLWire).
_PerPeer = Callable[[LLWire], tuple[int, ...]]


@dataclass(frozen=True)
class LLLinkBytes:
    """Per LL op, the bytes each GPU of the group sends and receives in one call."""

    dispatch_fp8: LinkLoad
    dispatch_bf16: LinkLoad
    combine: LinkLoad


def ll_link_bytes(wires: Sequence[LLWire]) -> LLLinkBytes:
    """Every GPU's link bytes of one call of each LL op, from every rank's :func:`ll_wire_bytes`
    (``wires[r]`` of rank ``r``).

    Dispatch: GPU ``g`` sends what its tokens send and receives what its peers' tokens send it.
    Combine: ``g`` sends its weights to its peers and the partials of its peers' tokens back to
    them; it receives its peers' weights and the partials of its own tokens.
    """
    world = len(wires)
    for r, w in enumerate(wires):
        tuples = (w.dispatch_fp8, w.dispatch_bf16, w.combine_weights, w.combine_partials)
        if w.rank != r or any(len(t) != world for t in tuples):
            raise ValueError(f"wires[{r}]: expected rank {r}'s share over {world} ranks, got {w}")

    def load(out: _PerPeer, back: _PerPeer) -> LinkLoad:
        # out(w)[d]: bytes rank w.rank sends rank d; back(w)[d]: bytes d sends w.rank.
        sent = tuple(
            sum(out(wires[g])) + sum(back(wires[s])[g] for s in range(world)) for g in range(world)
        )
        received = tuple(
            sum(out(wires[s])[g] for s in range(world)) + sum(back(wires[g])) for g in range(world)
        )
        return LinkLoad(sent, received)

    def nothing(w: LLWire) -> tuple[int, ...]:
        return (0,) * world

    return LLLinkBytes(
        load(lambda w: w.dispatch_fp8, nothing),
        load(lambda w: w.dispatch_bf16, nothing),
        load(lambda w: w.combine_weights, lambda w: w.combine_partials),
    )
