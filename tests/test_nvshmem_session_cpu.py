"""Which groups may use the process's NVSHMEM session (CPU: the host-side decision only).

NVSHMEM is initialised once per process and never re-initialised (after ``nvshmem_finalize`` a
new init keeps the first bootstrap: NVIDIA/nvshmem issue #68). The first group that uses it
starts the session with its ranks as PEs; a later group reuses it only if its ranks are exactly
those PEs on the same GPUs in the same order, on every rank; any other group (a sub-group, a
group re-created without a rank that died, a rank whose process restarted) is refused with a
reason and keeps the ATen path. ``_C._nvshmem_session_decision`` is that decision
(native/transports/nvshmem/nvshmem_session_plan.cpp), fed with what each rank posts.
"""

from __future__ import annotations

import pytest

from ep_backend import _C

PLACES = ["hostA|0|0000:18:00.0", "hostA|1|0000:2a:00.0", "hostB|0|0000:18:00.0"]


def session(pe: int, pes: int, places: list[str], parked: int = 0) -> str:
    return f"{pe}:{pes}:{parked}:{_C._nvshmem_places_fingerprint(places)}"


def decide(sessions: list[str], places: list[str]) -> tuple[str, str]:
    return _C._nvshmem_session_decision(sessions, places)


def test_no_session_anywhere_starts_one() -> None:
    assert decide(["-"] * 3, PLACES) == ("start", "")


def test_the_same_ranks_reuse_the_session() -> None:
    posts = [session(r, 3, PLACES, parked=2) for r in range(3)]
    assert decide(posts, PLACES) == ("reuse", "")


def test_a_group_without_a_dead_rank_is_refused() -> None:
    # The session had 3 PEs; rank 2 died and the survivors re-created a group of 2.
    action, why = decide([session(r, 3, PLACES) for r in range(2)], PLACES[:2])
    assert action == "refuse"
    assert "PE 0 of 3" in why and "this group of 2 ranks" in why
    assert "died" in why and "ATen path" in why and "issue #68" in why


def test_other_gpus_or_order_are_refused() -> None:
    swapped = [PLACES[1], PLACES[0], PLACES[2]]
    action, why = decide([session(r, 3, PLACES) for r in range(3)], swapped)
    assert action == "refuse" and "other GPUs or ranks" in why


def test_ranks_in_another_pe_order_are_refused() -> None:
    posts = [session(1, 3, PLACES), session(0, 3, PLACES), session(2, 3, PLACES)]
    action, why = decide(posts, PLACES)
    assert action == "refuse" and "rank 0's NVSHMEM session is PE 1 of 3" in why


def test_a_restarted_process_without_a_session_is_refused() -> None:
    posts = [session(0, 3, PLACES), "-", session(2, 3, PLACES)]
    action, why = decide(posts, PLACES)
    assert action == "refuse"
    assert "rank 0 has an NVSHMEM session" in why and "rank 1 has none" in why


def test_disagreeing_parked_buffers_are_refused() -> None:
    posts = [session(0, 3, PLACES, 1), session(1, 3, PLACES, 1), session(2, 3, PLACES, 0)]
    action, why = decide(posts, PLACES)
    assert action == "refuse" and "rank 0: 1, rank 2: 0" in why


def test_fingerprint_is_stable_and_order_sensitive() -> None:
    a = _C._nvshmem_places_fingerprint(PLACES)
    assert a == _C._nvshmem_places_fingerprint(list(PLACES))
    assert len(a) == 16 and int(a, 16) >= 0
    assert a != _C._nvshmem_places_fingerprint(PLACES[::-1])
    assert a != _C._nvshmem_places_fingerprint(PLACES[:2])


def test_malformed_session_post_raises_value_error() -> None:
    with pytest.raises(ValueError, match="malformed NVSHMEM session post"):
        decide(["0:x"], PLACES[:1])


def test_no_session_without_a_low_latency_call() -> None:
    # A fresh process (a CPU build, or no NVSHMEM call yet) has no session to report.
    assert tuple(_C._nvshmem_session()) == (False, -1, 0)
