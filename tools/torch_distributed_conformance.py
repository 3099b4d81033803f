"""PyTorch's own distributed test suite against ``ep`` and against Gloo, and their difference.

The suite is ``torch.testing._internal.distributed.distributed_test`` (what PyTorch's
``test/distributed/test_distributed_spawn.py`` wraps), run on CPU ranks. It reads its setting
from the environment at import: ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD``
(both set by ``common_distributed.initialize_temp_directories``). Many tests gate on backend
names (``BACKEND == "gloo"``, ``require_backend_is_available({"gloo"})``,
``DistTestCases.backend_feature``): for ``BACKEND=ep`` this script loads the suite with ``ep``
accepted wherever ``gloo`` is, since ``ep`` runs every standard collective (CPU tensors through
its inner Gloo backend).

For ``BACKEND=ep`` it also makes ``torch.distributed.monitored_barrier`` accept ``ep`` groups
(torch refuses every backend not named ``gloo`` in Python; ``ep_backend.monitored_barrier`` is
the same barrier through ep's inner Gloo backend).

``--subset ci`` selects the collectives-focused tests CI runs (``CI_SUBSET``: every standard
collective, point-to-point, barriers and monitored barriers, object collectives), a few
minutes on 2 cores.

Usage::

    python tools/torch_distributed_conformance.py --subset ci     # CI's subset, both
    python tools/torch_distributed_conformance.py                 # the whole suite, both
    python tools/torch_distributed_conformance.py -k all_reduce   # tests whose name has it
    python tools/torch_distributed_conformance.py --backend ep --json out.json   # one backend

Prints the outcome counts of each backend, then every test whose outcome differs. Exits 1 if
a test that passes on Gloo does not pass on ``ep``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import unittest

SUITE = "torch.testing._internal.distributed.distributed_test"
WORLD_SIZE = "2"

# The collectives-focused tests CI runs on both backends (one or two variants of each family:
# each test spawns two fresh processes, about 2 s).
CI_SUBSET = (
    r"^test_("
    r"get_backend|barrier|barrier_group|broadcast|broadcast_group|send_recv|send_recv_any_source|"
    r"send_recv_with_tag|isend|irecv|batch_isend_irecv_gloo|reduce_sum|reduce_group_max|"
    r"all_reduce_sum|all_reduce_sum_async|all_reduce_group_min|all_reduce_coalesced_sum|"
    r"scatter|gather|all_gather|all_gather_group|all_gather_coalesced_simple|all_to_all|"
    r"all_to_all_single_unequal_split|all_to_all_group|all_gather_object_default_pg|"
    r"broadcast_object_list|monitored_barrier_gloo|monitored_barrier_gloo_subgroup|"
    r"monitored_barrier_wait_all_ranks"
    r")$"
)
SUBSETS = {"ci": CI_SUBSET, "all": ""}


def _load_suite(backend: str) -> types.ModuleType:
    """Imports the suite with ``ep`` accepted wherever it names ``gloo`` (for BACKEND=ep)."""
    import importlib.util

    from torch.testing._internal import common_distributed

    if backend == "ep":
        import ep_backend  # registers the backend name "ep"

        features = common_distributed.DistTestCases.backend_feature
        for names in features.values():
            if "gloo" in names:
                names.add("ep")
        features["plugin"].add("ep")
        import torch.distributed as dist

        # torch's monitored_barrier refuses non-"gloo" names in Python; ep's is the same call.
        dist.monitored_barrier = ep_backend.monitored_barrier
    spec = importlib.util.find_spec(SUITE)
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as f:
        source = f.read()
    if backend == "ep":
        source = source.replace('BACKEND == "gloo"', 'BACKEND in ("gloo", "ep")')
        source = source.replace('BACKEND != "gloo"', 'BACKEND not in ("gloo", "ep")')
        source = re.sub(r'require_backend_is_available\(\{"gloo"', '\\g<0>, "ep"', source)
    module = types.ModuleType(SUITE)
    module.__file__ = spec.origin
    sys.modules[SUITE] = module
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    return module


def _test_class(backend: str) -> type:
    """The suite's test class, as test_distributed_spawn.py defines it (one process per rank)."""
    suite = _load_suite(backend)

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    return TestDistBackendWithSpawn


if os.environ.get("EP_CONFORMANCE_BACKEND"):
    # Set in the runner process and (spawn re-imports this module) in every rank process.
    TestDistBackendWithSpawn = _test_class(os.environ["EP_CONFORMANCE_BACKEND"])


def _run_one_backend(pattern: str, out_path: str) -> None:
    """Runs the selected tests in this process (its env names the backend); writes outcomes."""
    from torch.testing._internal.common_distributed import initialize_temp_directories

    initialize_temp_directories()
    loader = unittest.TestLoader()
    tests = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    selected = unittest.TestSuite(t for t in tests if re.search(pattern, t.id().rsplit(".", 1)[-1]))
    stream = unittest.runner._WritelnDecorator(sys.stderr)  # type: ignore[attr-defined]
    result = unittest.TextTestResult(stream, descriptions=False, verbosity=1)
    outcomes: dict[str, str] = {}
    original = {
        "addSuccess": result.addSuccess,
        "addFailure": result.addFailure,
        "addError": result.addError,
        "addSkip": result.addSkip,
    }

    def name(test: unittest.TestCase) -> str:
        return test.id().rsplit(".", 1)[-1]

    result.addSuccess = lambda t: (
        outcomes.__setitem__(name(t), "passed"),
        original["addSuccess"](t),
    )  # type: ignore[method-assign]
    result.addFailure = lambda t, e: (
        outcomes.__setitem__(name(t), "failed"),
        original["addFailure"](t, e),
    )  # type: ignore[method-assign]
    result.addError = lambda t, e: (
        outcomes.__setitem__(name(t), "failed"),
        original["addError"](t, e),
    )  # type: ignore[method-assign]
    result.addSkip = lambda t, r: (
        outcomes.__setitem__(name(t), "skipped"),
        original["addSkip"](t, r),
    )  # type: ignore[method-assign]
    selected.run(result)
    result.printErrors()
    with open(out_path, "w") as f:
        json.dump(outcomes, f, indent=1, sort_keys=True)


def run_backend(backend: str, pattern: str, timeout: float) -> dict[str, str]:
    """The selected tests' outcomes on ``backend`` ("ep" or "gloo"), run in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.json")
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=WORLD_SIZE)
        env["EP_CONFORMANCE_BACKEND"] = backend
        env.setdefault("OMP_NUM_THREADS", "1")
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        code = (
            f"import torch_distributed_conformance as c; c._run_one_backend({pattern!r}, {out!r})"
        )
        subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout, check=False)
        if not os.path.exists(out):
            raise RuntimeError(f"the {backend} run wrote no outcomes (see its output above)")
        with open(out) as f:
            return json.load(f)


def difference(ep: dict[str, str], gloo: dict[str, str]) -> list[tuple[str, str, str]]:
    """(test, outcome on ep, outcome on gloo) for every test whose outcomes differ."""
    names = sorted(set(ep) | set(gloo))
    return [(n, ep.get(n, "-"), gloo.get(n, "-")) for n in names if ep.get(n) != gloo.get(n)]


def _counts(outcomes: dict[str, str]) -> str:
    kinds = ("passed", "failed", "skipped")
    return ", ".join(f"{sum(v == k for v in outcomes.values())} {k}" for k in kinds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="regex: run the tests whose name matches")
    parser.add_argument(
        "--subset",
        choices=sorted(SUBSETS),
        help="a named selection (ci: what CI runs); with -k, both",
    )
    parser.add_argument("--backend", choices=("ep", "gloo"), help="run only this backend")
    parser.add_argument("--json", help="write the outcomes (or both runs') to this file")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per backend")
    args = parser.parse_args()
    backends = (args.backend,) if args.backend else ("ep", "gloo")
    pattern = args.k
    if args.subset:
        subset = SUBSETS[args.subset]
        pattern = f"(?=.*(?:{args.k})){subset}" if args.k else subset
    runs = {}
    for backend in backends:
        start = time.monotonic()
        runs[backend] = run_backend(backend, pattern, args.timeout)
        took = time.monotonic() - start
        print(f"{backend}: {_counts(runs[backend])} ({took:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1, sort_keys=True)
    if len(runs) < 2:
        return 0
    diff = difference(runs["ep"], runs["gloo"])
    print(f"{len(diff)} test(s) differ (ep / gloo):")
    for name, on_ep, on_gloo in diff:
        print(f"  {name}: {on_ep} / {on_gloo}")
    regressions = [n for n, on_ep, on_gloo in diff if on_gloo == "passed" and on_ep != "passed"]
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
