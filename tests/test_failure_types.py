"""How a native error's message maps to the public MoE error types (``ep_backend._failures``).

Each case is a message of the form the native code raises; the table says which class every rank
sees and which ranks ``exc.ranks`` names. The multi-process tests (test_moe_timeouts,
test_recovery, test_rank_mask) raise these for real; this pins the mapping itself.
"""

from __future__ import annotations

import pytest

from ep_backend._failures import _translate
from ep_backend.errors import MoEInputError, MoETimeoutError

CASES = [
    ("ep dispatch: rank 0 waited 20 s for the other ranks of the group to join this call; "
     "rank(s) 1, 3 never joined it", MoETimeoutError, (1, 3)),
    ("ep low_latency_dispatch: rank 2 was masked by rank(s) 0, 1: it joined this call after "
     "their auto-mask timeout of 2000 ms", MoETimeoutError, (0, 1)),
    ("ep dispatch: rank 1 timed out after 3 s waiting for rank 3", MoETimeoutError, (3,)),
    ("ep combine: rank(s) 2 rejected their inputs (rank 0; nothing was exchanged)",
     MoEInputError, (2,)),
]  # fmt: skip


@pytest.mark.parametrize(("message", "kind", "ranks"), CASES)
def test_native_messages_map_to_their_class_and_ranks(
    message: str, kind: type[BaseException], ranks: tuple[int, ...]
) -> None:
    exc = _translate("op", RuntimeError(message))
    assert type(exc) is kind, (type(exc), message)
    assert tuple(exc.ranks) == ranks, (exc.ranks, message)


def test_other_errors_are_left_as_they_are() -> None:
    original = ValueError("not an MoE failure")
    assert _translate("op", original) is original
    plain = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert _translate("op", plain) is plain
