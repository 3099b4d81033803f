"""Run a function on a small local process group, for tests: ``run_distributed``.

Example::

    from _dist_utils import run_distributed

    def _worker(rank: int, world_size: int, hidden: int) -> float:  # module level: picklable
        x = torch.full((hidden,), float(rank))
        dist.all_reduce(x)
        return float(x[0])

    def test_all_reduce():
        assert run_distributed(_worker, 4, 8) == [6.0] * 4

What it does:

* starts ``world_size`` fresh processes, by default forked from a ``forkserver`` that has
  imported ``FORKSERVER_PRELOAD`` (torch...) but never touched CUDA, so workers start in
  milliseconds and can still use CUDA (``start_method="spawn"`` is the slow, fully fresh
  alternative); each worker gets the parent's current environment plus ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1),
  ``MASTER_PORT`` and any ``env`` you pass, applied before ``fn`` is unpickled; unless
  ``OMP_NUM_THREADS`` is set, each worker uses ``cpu_count // world_size`` torch threads;
* the parent hosts a ``TCPStore`` on 127.0.0.1 on a port the OS picks (no port races between
  parallel tests); every worker calls ``init_process_group(backend, store=...)`` on it, with
  ``timeout`` as the process-group timeout, after importing the modules that register
  ``backend`` (``"ep"`` imports ``ep_backend``; see ``BACKEND_MODULES`` and ``import_modules``)
  and, when CUDA is available, ``torch.cuda.set_device(rank % device_count)``;
* runs ``fn(rank, world_size, *args)``, then ``destroy_process_group()``;
* returns the per-rank return values (they must pickle; return CPU tensors or plain values).

It never hangs: if a worker raises, the others get ``grace`` seconds to finish (they are often
stuck in a collective waiting for the failed rank) and are then killed; after ``timeout``
seconds all workers still running are killed. Before a worker is killed unfinished it is sent
SIGUSR1 (it dumps its Python stacks to stderr, which pytest shows with the failure), and its
native stacks are printed (gdb), or without gdb each thread's state and kernel wait channel. The parent then raises:

* the worker's own exception object (so ``pytest.raises(ValueError)`` works, and
  ``pytest.skip(...)`` inside a worker skips the test), chained ``from`` a ``RemoteTraceback``
  that holds the formatted tracebacks of every failed rank, the first failure first;
* ``WorkerError`` when the exception does not pickle, a worker died without one (exit code,
  signal), or a worker returned its result and then exited with a non-zero code (a crash in
  ``destroy_process_group`` or at exit);
* ``DistributedTimeout`` (a ``TimeoutError``) on timeout.

``backend`` is passed to ``init_process_group`` unchanged: ``"gloo"``, ``"nccl"``, ``"ep"``,
``"cpu:gloo,cuda:nccl"``... ``fn`` and ``args`` must pickle: define ``fn`` at module level of an
importable module (test modules are importable because pytest puts their folder on
``sys.path``, and the workers inherit ``sys.path``). A test module's top level runs again in
every worker when ``fn`` is unpickled: keep it cheap and free of side effects.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_MODULES",
    "DistributedTimeout",
    "RemoteTraceback",
    "WorkerError",
    "gpu_world_size",
    "run_distributed",
]

HOST = "127.0.0.1"

BACKEND_MODULES: dict[str, str] = {"ep": "ep_backend"}
"""Backend name -> module whose import registers it (imported in each worker before init)."""

_MSG_OK = "ok"
_MSG_ERROR = "error"
_MSG_TEARDOWN = "teardown"  # after the result: seconds destroy_process_group took

EXIT_GRACE_S = 10.0
"""How long finished workers get, all together, to tear down and exit before they are killed."""

SLOW_TEARDOWN_S = 5.0
"""A worker slower than this to tear down or to exit is reported (``SlowTeardownWarning``)."""


class SlowTeardownWarning(UserWarning):
    """A worker was slow to leave after its result (group teardown or process exit): the test
    still passes, but the time is spent on every run and often hides a wait for a peer."""


def gpu_world_size() -> int:
    """Ranks the GPU tests run on: ``EP_TEST_WORLD_SIZE`` if set, else one per visible GPU.

    At least 2 (two ranks may share one GPU), so that a 4- or 8-GPU machine runs every GPU test
    at EP4 / EP8 without any flag.
    """
    forced = os.environ.get("EP_TEST_WORLD_SIZE")
    if forced:
        return max(1, int(forced))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(2, gpus)


class RemoteTraceback(Exception):
    """Formatted traceback(s) of failed workers; the ``__cause__`` of the re-raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class WorkerError(RuntimeError):
    """A worker failed in a way that cannot be re-raised as its own exception."""


class DistributedTimeout(TimeoutError):
    """``run_distributed`` ran past its timeout; the workers were killed."""


FORKSERVER_PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "pytest")
"""Modules the forkserver imports once, so that workers start without importing them again."""


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _backend_names(backend: str) -> list[str]:
    """``"cpu:gloo,cuda:ep"`` -> ``["gloo", "ep"]``; ``"ep"`` -> ``["ep"]``."""
    return [part.split(":")[-1].strip() for part in backend.split(",") if part.strip()]


def _worker_main(
    payload: bytes,
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    timeout: float,
    env: Mapping[str, str],
    import_modules: Sequence[str],
    set_cuda_device: bool | None,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of one worker process: set up the group, run ``fn``, report, tear down.

    ``payload`` is ``pickle.dumps((fn, args))``; it is loaded only after ``env`` is applied, so
    that modules imported by unpickling already see the environment.
    """
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    os.environ.update(env)  # forkserver children do not inherit the parent's current environ
    # ...but they do inherit the forkserver's, which holds the env of the run that started it:
    # drop the ep variables the parent does not have now (``env`` is the parent's whole environ
    # plus the run's extras), so one run's EP_* settings never leak into later runs.
    for name in [k for k in os.environ if k.startswith("EP_") and k not in env]:
        del os.environ[name]
    # torch (preloaded by the forkserver) read TORCH_DISTRIBUTED_DEBUG before env was applied
    dist.set_debug_level_from_env()
    if "OMP_NUM_THREADS" not in env:  # share the cores: world_size workers x all cores thrashes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        try:
            for name in import_modules:
                importlib.import_module(name)
            fn, args = pickle.loads(payload)
            use_cuda = torch.cuda.is_available() if set_cuda_device is None else set_cuda_device
            if use_cuda and torch.cuda.device_count() > 0:
                torch.cuda.set_device(rank % torch.cuda.device_count())
            pg_timeout = datetime.timedelta(seconds=timeout)
            store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=pg_timeout)
            # env={"EP_TEST_BIND_DEVICE": "1"} binds the group to the rank's GPU (device_id=).
            device_id = None
            if os.environ.get("EP_TEST_BIND_DEVICE") == "1" and use_cuda:
                device_id = torch.device("cuda", rank % torch.cuda.device_count())
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout,
                device_id=device_id,
            )  # fmt: skip
            result = fn(rank, world_size, *args)
            message = (_MSG_OK, pickle.dumps(result))
        except BaseException as exc:
            text = f"[rank {rank}] " + traceback.format_exc()
            try:
                exc_bytes: bytes | None = pickle.dumps(exc)
                pickle.loads(exc_bytes)  # some exceptions pickle but do not unpickle
            except Exception:
                exc_bytes = None
            message = (_MSG_ERROR, (exc_bytes, type(exc).__name__, str(exc), text))
        conn.send_bytes(pickle.dumps(message))
    finally:
        try:
            started = time.monotonic()
            if dist.is_initialized():
                dist.destroy_process_group()
            with suppress(OSError, ValueError):  # the parent may have stopped listening
                conn.send_bytes(pickle.dumps((_MSG_TEARDOWN, time.monotonic() - started)))
        finally:
            conn.close()


@contextmanager
def _patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set environment variables (children started inside inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _print_thread_states(pid: int) -> None:
    """Without gdb: each thread's name, scheduler state (R: running, a spin; S: asleep) and the
    kernel function it sleeps in (futex_wait: a lock or condition variable; a socket or epoll
    wait: I/O), from /proc."""
    lines = []
    with suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            task = f"/proc/{pid}/task/{tid}"
            fields: dict[str, str] = {}
            for name in ("comm", "wchan", "stat"):
                with suppress(OSError), open(f"{task}/{name}") as f:
                    fields[name] = f.read().strip()
            state = fields.get("stat", "").rpartition(")")[2].split()[:1]
            lines.append(f"  tid {tid} {fields.get('comm', '?')!r}: state "
                         f"{state[0] if state else '?'}, wchan {fields.get('wchan', '?')}")  # fmt: skip
    print(f"--- threads of pid {pid} (no gdb) ---\n" + "\n".join(lines), file=sys.stderr)


def _dump_native_stacks(pid: int) -> None:
    """Print every thread's C/C++ stack of a hung worker (gdb, when present): Python's dump
    cannot show threads that hold or wait for the GIL outside Python code."""
    gdb = shutil.which("gdb")
    if gdb is None:
        _print_thread_states(pid)
        return
    with suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 40"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        print(f"--- native stacks of pid {pid} ---\n{out.stdout[-20000:]}", file=sys.stderr)


def _slow_teardown(
    procs: Sequence[multiprocessing.process.BaseProcess],
    conns: Sequence[multiprocessing.connection.Connection],
    results: Mapping[int, Any],
    finished_at: float,
) -> tuple[list[str], bool]:
    """The workers that reported a result but took over ``SLOW_TEARDOWN_S`` in
    ``destroy_process_group`` or were still alive after the grace period, one line each (the
    caller warns with ``SlowTeardownWarning`` once they are stopped), and whether some are still
    alive (their stacks are then dumped before they are killed)."""
    lines: list[str] = []
    still_alive = False
    for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True)):
        if rank not in results:
            continue
        teardown: float | None = None
        with suppress(OSError, EOFError, pickle.UnpicklingError):
            if conn.poll(0):
                kind, seconds = pickle.loads(conn.recv_bytes())
                if kind == _MSG_TEARDOWN:
                    teardown = float(seconds)
        waited = time.monotonic() - finished_at
        if proc.is_alive():
            still_alive = True
            where = (
                "still in destroy_process_group" if teardown is None
                else f"past destroy_process_group ({teardown:.1f} s) but not exited"
            )  # fmt: skip
            lines.append(f"rank {rank}: {where} {waited:.1f} s after the last result (killed)")
        elif teardown is not None and teardown > SLOW_TEARDOWN_S:
            lines.append(f"rank {rank}: destroy_process_group took {teardown:.1f} s")
    return lines, still_alive


def _stop(procs: Sequence[multiprocessing.process.BaseProcess], dump_stacks: bool) -> None:
    """Terminate, then kill, every process still alive (optionally dumping its stacks first)."""
    alive = [p for p in procs if p.is_alive()]
    if dump_stacks and alive and hasattr(signal, "SIGUSR1"):
        for p in alive:
            if p.pid is not None:
                with suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
        for p in alive:
            if p.pid is not None:
                _dump_native_stacks(p.pid)
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + 3.0
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    import_modules: Sequence[str] = (),
    set_cuda_device: bool | None = None,
    start_method: str | None = None,
    grace: float = 5.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes in one group.

    Args:
        fn: picklable (module-level) function; its return value must pickle.
        world_size: number of processes (ranks).
        *args: extra positional arguments for ``fn`` (must pickle).
        backend: backend string for ``init_process_group`` (``"gloo"``, ``"nccl"``, ``"ep"``,
            ``"cpu:gloo,cuda:nccl"``...). Names found in ``BACKEND_MODULES`` get their module
            imported in each worker first.
        timeout: seconds for the whole run (process start included); also the process-group
            timeout inside the workers.
        env: extra environment variables for the workers (set before they start).
        import_modules: more modules to import in each worker before the group is created.
        set_cuda_device: ``True``/``False`` to force calling ``torch.cuda.set_device(rank %
            device_count)``; ``None`` calls it when CUDA is available.
        start_method: multiprocessing start method; ``None`` picks ``"forkserver"`` where
            available (workers fork from a server that has imported torch but never touched
            CUDA: fast and CUDA-safe), else ``"spawn"``. ``"fork"`` is unsafe with CUDA.
        grace: seconds the other workers get to finish after one has failed.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        The first failing worker's exception (chained from a ``RemoteTraceback``),
        ``WorkerError`` or ``DistributedTimeout``; see the module docstring.
    """
    assert world_size >= 1, "world_size must be >= 1"
    modules = list(import_modules)
    for name in _backend_names(backend):
        module = BACKEND_MODULES.get(name)
        if module is not None and module not in modules:
            modules.append(module)

    payload = pickle.dumps((fn, args))  # fails here, early, if fn or args do not pickle
    if start_method is None:
        start_method = _default_start_method()
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    deadline = time.monotonic() + timeout
    store = dist.TCPStore(
        HOST,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    port = store.port
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    results: dict[int, Any] = {}
    errors: list[tuple[int, bytes | None, str, str, str]] = []  # arrival order
    died: dict[int, str] = {}
    timed_out = False
    unfinished: list[int] = []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            rank_env = {
                **os.environ,  # what a spawned child would inherit (forkserver ones do not)
                "MASTER_ADDR": HOST,
                "MASTER_PORT": str(port),
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
                    port,
                    timeout,
                    rank_env,
                    modules,
                    set_cuda_device,
                    send_end,
                ),
                name=f"run_distributed-rank{rank}",
                daemon=True,
            )
            with _patched_environ(rank_env):
                proc.start()
            send_end.close()  # so that a dead worker reads as EOF here
            procs.append(proc)
            conns.append(recv_end)

        pending = set(range(world_size))
        failed_at: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + grace)
            if now >= limit:
                timed_out = failed_at is None
                break
            waitables: list[Any] = [conns[r] for r in pending]
            waitables += [procs[r].sentinel for r in pending]
            ready = multiprocessing.connection.wait(waitables, timeout=limit - now)
            for rank in sorted(pending):
                conn, proc = conns[rank], procs[rank]
                if conn in ready or conn.poll():
                    try:
                        kind, payload = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        proc.join(1.0)
                        died[rank] = (
                            f"[rank {rank}] died without a result, exit code {proc.exitcode}"
                        )
                        failed_at = failed_at or time.monotonic()
                        pending.discard(rank)
                        continue
                    if kind == _MSG_OK:
                        results[rank] = pickle.loads(payload)
                    else:
                        errors.append((rank, *payload))
                        failed_at = failed_at or time.monotonic()
                    pending.discard(rank)
                elif proc.sentinel in ready and not conn.poll(0.2):
                    proc.join(1.0)
                    died[rank] = f"[rank {rank}] died without a result, exit code {proc.exitcode}"
                    failed_at = failed_at or time.monotonic()
                    pending.discard(rank)
        unfinished = sorted(pending)
    finally:
        # Finished workers only tear down: one shared grace period, not one per worker.
        finished_at = time.monotonic()
        grace_end = min(deadline, finished_at + EXIT_GRACE_S) if not errors else finished_at
        for p in procs:
            if p.is_alive():
                p.join(max(0.0, grace_end - time.monotonic()))
        # (After an error the others are stopped at once; the stacks of those that never
        # reported say where they were held, often the cause of the first rank's error.)
        slow_lines, slow = [], False
        if not errors:
            slow_lines, slow = _slow_teardown(procs, conns, results, finished_at)
        killed = {rank for rank, p in enumerate(procs) if p.is_alive()}
        _stop(procs, dump_stacks=timed_out or slow or bool(killed & set(unfinished)))
        for c in conns:
            c.close()
        del store

    if slow_lines:  # out of the finally: under -W error this raises, after the workers stopped
        import warnings

        warnings.warn(
            "slow worker teardown: " + "; ".join(slow_lines), SlowTeardownWarning, stacklevel=2
        )
    # A worker that returned its result and then crashed (in destroy_process_group, at exit)
    # fails the run: that crash is a bug a user's job would hit too.
    if not (errors or died or timed_out):
        for rank in sorted(results):
            code = procs[rank].exitcode
            if rank not in killed and code not in (0, None):
                died[rank] = f"[rank {rank}] returned its result, then exited with code {code}"

    if errors or died:
        texts = [text for *_, text in errors] + list(died.values())
        if unfinished:
            texts.append(f"ranks {unfinished} were still running and were killed")
        cause = RemoteTraceback("\n".join(texts))
        if died:  # a crashed worker is the likeliest root cause; the others' errors follow it
            raise WorkerError("; ".join(died.values())) from cause
        rank, exc_bytes, type_name, text, _ = errors[0]
        if exc_bytes is not None:
            exc = pickle.loads(exc_bytes)
            if isinstance(exc, BaseException):
                raise exc from cause
        if type_name == "Skipped":  # pytest.skip() in a worker; its class does not pickle
            import pytest

            pytest.skip(text)
        raise WorkerError(f"rank {rank} raised {type_name}: {text}") from cause
    if timed_out:
        raise DistributedTimeout(
            f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}, "
            f"backend={backend!r}) timed out after {timeout:.0f} s; ranks {unfinished} were "
            "still running and were killed (their stacks were dumped to stderr)"
        )
    return [results[r] for r in range(world_size)]
