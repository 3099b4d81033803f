"""A rank killed with SIGKILL in the middle of a dispatch, on CPU (Gloo) ranks.

The victim dies just before its dispatch while its peers wait for it in theirs (in the call's
agreement: they find its process gone within a second), or after the agreement while its peers
wait for its rows in the data exchange (Gloo's connections close). The survivors raise
``MoETimeoutError`` naming the victim before the group timeout, abort the group,
build a new ``"ep"`` group of the survivors alone, whose dispatch + combine equal the reference
bit for bit, and exit cleanly (exit code 0, no hang in ``destroy_process_group``). See
``killed_rank_cases`` for the scenario and ``_killed_rank_harness`` for the harness.
"""

from __future__ import annotations

import pytest
from _killed_rank_harness import run_with_killed_rank
from killed_rank_cases import Timing, check_survivors, killed_mid_call, summary

TIMING = Timing(group_timeout=3.0, kernel_timeout=3.0, step_bound=20.0)


# "gloo": the agreement of ranks on different hosts (forced here by EP_HOST_EXCHANGE), whose
# allgather fails as soon as the victim's connections close; the victim ran on this host, so its
# process is still looked up and found gone.
@pytest.mark.parametrize("exchange", ["shared_memory", "gloo"])
@pytest.mark.parametrize("case", ["before_call", "after_agreement"])
@pytest.mark.parametrize(("world", "victim"), [(2, 1), (3, 1)])
def test_survivors_of_a_killed_rank_raise_abort_and_rebuild(
    world: int, victim: int, case: str, exchange: str
) -> None:
    env = {"EP_HOST_EXCHANGE": "gloo"} if exchange == "gloo" else {}
    run = run_with_killed_rank(killed_mid_call, world, victim, case, TIMING,
                               timeout=120, exit_within=30, env=env)  # fmt: skip
    assert sorted(run.results) == [r for r in range(world) if r != victim], run
    print(summary(run))  # shown with -rP (tools/verify_next.sh) or on failure
    problems = check_survivors(run, case, TIMING)
    assert not problems, "\n".join(problems)
    for rank, res in run.results.items():
        message = res["call"]["error"]["message"]
        if case == "before_call":  # found gone while waiting: before the group timeout
            assert res["call"]["seconds"] < TIMING.group_timeout, (rank, res)
            assert f"rank(s) {victim} never joined this call and never will" in message, (
                rank, message)  # fmt: skip
            assert "their process is gone" in message, (rank, message)
        else:  # the peer's connections closed: at once, no timeout to wait out
            assert res["call"]["seconds"] < 3.0, (rank, res)
            assert f"rank(s) {victim} died during this call" in message, (rank, message)
