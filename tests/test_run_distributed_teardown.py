"""The test harness reports workers that are slow to leave after their result.

A worker sends its result, then destroys its process groups; the harness gives all finished
workers one shared grace period (``EXIT_GRACE_S``) and warns (``SlowTeardownWarning``) about any
that spent over ``SLOW_TEARDOWN_S`` in ``destroy_process_group`` or were still alive at its end,
so that a teardown waiting for a peer shows up in a passing run instead of silently costing time.
A worker that crashes after its result (a non-zero exit code) fails the run.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from _dist_utils import SLOW_TEARDOWN_S, SlowTeardownWarning, run_distributed


def _slow_destroy(rank: int, world: int, slow_rank: int, seconds: float) -> int:
    if rank == slow_rank:
        original = dist.destroy_process_group

        def slow(*args: object, **kwargs: object) -> None:
            time.sleep(seconds)
            original(*args, **kwargs)

        dist.destroy_process_group = slow  # the harness calls it after sending the result
    return rank * 10


def test_slow_destroy_is_reported_and_the_result_kept() -> None:
    start = time.monotonic()
    with pytest.warns(SlowTeardownWarning, match=r"rank 1: destroy_process_group took [67]\.\d s"):
        res = run_distributed(_slow_destroy, 2, 1, SLOW_TEARDOWN_S + 1.5, backend="gloo")
    assert res == [0, 10]
    assert time.monotonic() - start < 30


def test_a_worker_stuck_in_teardown_is_killed_after_one_shared_grace_period() -> None:
    start = time.monotonic()
    with pytest.warns(SlowTeardownWarning) as seen:
        res = run_distributed(_slow_destroy, 3, 2, 120.0, backend="gloo")
    assert res == [0, 10, 20]
    text = " ".join(str(w.message) for w in seen)
    assert "rank 2: still in destroy_process_group" in text and "(killed)" in text, text
    assert "rank 0" not in text and "rank 1" not in text, text
    # one grace period of 10 s (not one per worker), then the stack dump and the kill
    assert time.monotonic() - start < 45


def _crash_in_destroy(rank: int, world: int, crash_rank: int) -> int:
    if rank == crash_rank:
        import os

        def crash(*args: object, **kwargs: object) -> None:
            os._exit(139)  # as a segfault in a backend's teardown would end the process

        dist.destroy_process_group = crash  # the harness calls it after sending the result
    return rank


def test_a_worker_that_crashes_after_its_result_fails_the_run() -> None:
    from _dist_utils import WorkerError

    with pytest.raises(
        WorkerError, match=r"rank 1\] returned its result, then exited with code 139"
    ):
        run_distributed(_crash_in_destroy, 2, 1, backend="gloo")
