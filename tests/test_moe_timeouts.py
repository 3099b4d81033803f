"""A rank that never joins an MoE call makes the others raise, naming it, instead of hanging."""

from __future__ import annotations

import datetime
import time

import torch
from _dist_utils import run_distributed


def _absent_rank(rank: int, world: int) -> dict:
    import ep_backend as ep

    ep.get_backend().set_timeout(datetime.timedelta(seconds=3))
    x = torch.randn(8, 64).bfloat16()
    idx = torch.randint(0, 9, (8, 2))
    ep.dispatch(x, idx, None, 9)  # everyone takes part once
    if rank == world - 1:
        time.sleep(9)  # alive, but skips the next call
        return {"skipped": True}
    start = time.monotonic()
    try:
        ep.dispatch(x, idx, None, 9)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    return {"skipped": False, "message": message, "seconds": time.monotonic() - start}


def test_absent_rank_is_named_within_the_timeout() -> None:
    res = run_distributed(_absent_rank, 3, backend="ep", timeout=60)
    assert res[2] == {"skipped": True}
    for r in res[:2]:
        assert f"rank(s) {2} never joined it" in r["message"], r["message"]
        assert "ep dispatch" in r["message"]
        assert r["seconds"] < 8.5, r["seconds"]  # 3 s timeout + 2 s to name the peer + slack
