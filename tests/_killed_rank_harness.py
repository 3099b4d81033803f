"""Run a function on local ranks of which one is expected to die: ``run_with_killed_rank``.

``run_distributed`` (``_dist_utils``) treats a rank that dies as the test's failure and kills
the others. The tests of a rank killed with SIGKILL mid-call need the opposite: the victim's
death is the scenario, and what matters is what its peers (the survivors) report and whether
they then exit cleanly. This harness starts the ranks the same way (``_dist_utils._worker_main``:
a forkserver that never touched CUDA, a ``TCPStore`` hosted here, ``init_process_group``,
``fn(rank, world_size, victim, *args)``, ``destroy_process_group()``), and then:

* waits, under one deadline, for every survivor's result and for the victim's death;
* after a survivor sent its result, gives it ``exit_within`` seconds to tear down its groups and
  exit (its ``destroy_process_group`` runs then), and records its exit code and how long that
  took;
* kills every process still alive at the end (stragglers), dumping their Python stacks first.

It raises only for harness failures (a survivor that raised, or the deadline); everything the
test asserts is in the returned ``KilledRankRun``.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from _dist_utils import (
    _MSG_OK,
    FORKSERVER_PRELOAD,
    HOST,
    WorkerError,
    _default_start_method,
    _patched_environ,
    _stop,
    _worker_main,
)

__all__ = ["KilledRankRun", "run_with_killed_rank", "sigkill_self_after"]


@dataclass
class KilledRankRun:
    """What happened to each rank of a run in which ``victim`` was to be killed.

    Attributes:
        victim: the rank expected to die.
        victim_exitcode: its exit code as ``multiprocessing`` reports it (``-9`` after SIGKILL;
            ``None`` if it was still alive at the deadline and the harness killed it).
        results: survivor rank -> the value its ``fn`` returned.
        exitcodes: survivor rank -> exit code (``None``: still alive ``exit_within`` seconds
            after its result, killed by the harness).
        exit_seconds: survivor rank -> seconds from its result to its exit (teardown time).
    """

    victim: int
    victim_exitcode: int | None = None
    results: dict[int, Any] = field(default_factory=dict)
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    exit_seconds: dict[int, float] = field(default_factory=dict)


def run_with_killed_rank(
    fn: Callable[..., Any],
    world_size: int,
    victim: int,
    *args: Any,
    backend: str = "ep",
    timeout: float = 120.0,
    exit_within: float = 30.0,
    env: Mapping[str, str] | None = None,
    import_modules: tuple[str, ...] = ("ep_backend",),
) -> KilledRankRun:
    """Runs ``fn(rank, world_size, victim, *args)`` on ``world_size`` ranks; ``victim`` must die.

    Args:
        fn: module-level (picklable) function; survivors return a picklable value; the victim
            is expected to kill itself (or be killed) and never return.
        world_size: ranks, at least 2.
        victim: the rank expected to die, in ``[0, world_size)``.
        *args: more arguments for ``fn``.
        backend: ``init_process_group`` backend of WORLD.
        timeout: seconds for the whole run (deadline of every wait here); also the process-group
            timeout of WORLD inside the workers.
        exit_within: seconds a survivor gets, after its result arrived, to exit.
        env: extra environment variables for the workers.
        import_modules: modules each worker imports before ``init_process_group``.

    Raises:
        WorkerError: a survivor raised, or died without a result.
        TimeoutError: a survivor sent no result before the deadline (all processes are killed).
    """
    if world_size < 2 or not 0 <= victim < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= victim < world_size, got {world_size}, "
                         f"{victim}")  # fmt: skip
    payload = pickle.dumps((fn, (victim, *args)))
    start_method = _default_start_method()
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    deadline = time.monotonic() + timeout
    store = dist.TCPStore(HOST, 0, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)  # fmt: skip
    run = KilledRankRun(victim=victim)
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    failures: list[str] = []
    result_at: dict[int, float] = {}
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            rank_env = {
                **os.environ,
                "MASTER_ADDR": HOST,
                "MASTER_PORT": str(store.port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                **dict(env or {}),
            }
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    payload,
                    rank,
                    world_size,
                    backend,
                    store.port,
                    timeout,
                    rank_env,
                    list(import_modules),
                    None,
                    send_end,
                ),  # fmt: skip
                name=f"killed_rank-rank{rank}",
                daemon=True,
            )
            with _patched_environ(rank_env):
                proc.start()
            send_end.close()
            procs.append(proc)
            conns.append(recv_end)

        survivors = [r for r in range(world_size) if r != victim]
        waiting = set(survivors)  # for a result
        victim_alive = True
        while (waiting or victim_alive) and time.monotonic() < deadline:
            waitables: list[Any] = [conns[r] for r in waiting] + [
                procs[r].sentinel for r in waiting
            ]
            if victim_alive:
                waitables.append(procs[victim].sentinel)
            multiprocessing.connection.wait(waitables, timeout=deadline - time.monotonic())
            if victim_alive and not procs[victim].is_alive():
                procs[victim].join(1.0)
                run.victim_exitcode = procs[victim].exitcode
                victim_alive = False
            for rank in sorted(waiting):
                if conns[rank].poll():
                    try:
                        kind, body = pickle.loads(conns[rank].recv_bytes())
                    except EOFError:
                        failures.append(f"rank {rank} died without a result "
                                        f"(exit code {procs[rank].exitcode})")  # fmt: skip
                        waiting.discard(rank)
                        continue
                    result_at[rank] = time.monotonic()
                    if kind == _MSG_OK:
                        run.results[rank] = pickle.loads(body)
                    else:
                        failures.append(f"rank {rank} raised {body[1]}: {body[3]}")
                    waiting.discard(rank)
                elif not procs[rank].is_alive():
                    failures.append(f"rank {rank} died without a result "
                                    f"(exit code {procs[rank].exitcode})")  # fmt: skip
                    waiting.discard(rank)
        if waiting:
            failures.append(f"ranks {sorted(waiting)} sent no result within {timeout:.0f} s")

        # Teardown: each survivor that reported gets exit_within seconds from its result. All are
        # watched at once, so each one's exit time is taken when it exits, not when its turn in
        # a sequence of joins comes.
        limits = {
            rank: min(deadline + exit_within, result_at[rank] + exit_within)
            for rank in survivors
            if rank in result_at
        }
        while True:
            now = time.monotonic()
            for rank in list(limits):
                if not procs[rank].is_alive():
                    procs[rank].join()
                    run.exitcodes[rank] = procs[rank].exitcode
                    run.exit_seconds[rank] = now - result_at[rank]
                    del limits[rank]
                elif now >= limits[rank]:
                    run.exitcodes[rank] = None
                    del limits[rank]
            if not limits:
                break
            sentinels = [procs[rank].sentinel for rank in limits]
            multiprocessing.connection.wait(sentinels, timeout=min(limits.values()) - now)
    finally:
        stragglers = [p for p in procs if p.is_alive()]
        _stop(procs, dump_stacks=bool(stragglers))
        for c in conns:
            c.close()
        del store
    if failures:
        raise (TimeoutError if waiting else WorkerError)("; ".join(failures))
    return run


def sigkill_self_after(seconds: float) -> None:
    """SIGKILLs this process after ``seconds``, from a helper process: it fires even while this
    process's threads are blocked in C++ (holding the GIL or not). Returns at once."""
    import subprocess

    subprocess.Popen(
        ["/bin/sh", "-c", f"sleep {seconds:.3f}; kill -{int(signal.SIGKILL)} {os.getpid()}"],
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
