"""A rank killed with SIGKILL while its peers are inside a dispatch kernel, on CUDA.

One rank per GPU (2 or more). Every rank makes normal high-throughput (NVLink) and low-latency
(NVSHMEM where built) calls, so both runtimes exist; then the victim holds its stream busy,
enters a dispatch with its peers (the host agreement passes) and dies by SIGKILL while their
kernels wait for its data. The survivors must:

* raise ``MoETimeoutError`` naming the victim (``exc.ranks`` and the message), within the
  kernel timeout plus the group timeout (short ones here: 3 s and 6 s);
* be left with no kernel spinning: ``torch.cuda.synchronize()`` returns, a later CUDA op works;
* ``ep_backend.abort(group)`` without hanging (the dead rank's IPC mappings are closed; the
  NVSHMEM buffers, whose free would wait for the dead PE forever, stay allocated, see docs/api.md);
* build a new ``"ep"`` group of the survivors whose dispatch + combine (and low-latency dispatch,
  on ATen: the process's NVSHMEM session lost a PE and is never re-initialised) equal the
  reference bit for bit;
* exit with code 0 (``destroy_process_group`` at exit does not hang).

Cases: a high-throughput dispatch (victim: the last rank) and a low-latency dispatch (victim:
rank 0, which also created NVSHMEM's unique id).
"""

from __future__ import annotations

import pytest
from _dist_utils import gpu_world_size
from _killed_rank_harness import run_with_killed_rank
from killed_rank_cases import Timing, check_survivors, killed_mid_call, summary
from moe_helpers import nvshmem_built

TIMING = Timing(group_timeout=6.0, kernel_timeout=3.0, step_bound=30.0)


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("case", ["ht_dispatch", "ll_dispatch"])
def test_survivors_of_a_rank_killed_mid_dispatch_on_cuda(case: str) -> None:
    if case == "ll_dispatch" and not nvshmem_built():
        # Without NVSHMEM the low-latency ops run NCCL's all-to-all, whose kernels have no
        # timeout of ep's (see docs/api.md "Failures"): a dead peer is not what this case tests.
        pytest.skip("libep_nvshmem.so was not built: the low-latency ops run on ATen (NCCL)")
    world = gpu_world_size()
    victim = world - 1 if case == "ht_dispatch" else 0
    run = run_with_killed_rank(killed_mid_call, world, victim, case, TIMING,
                               timeout=150, exit_within=40)  # fmt: skip
    assert sorted(run.results) == [r for r in range(world) if r != victim], run
    print(summary(run))  # shown with -rP (tools/verify_next.sh) or on failure
    problems = check_survivors(run, case, TIMING)
    assert not problems, "\n".join(problems)
    for rank, res in run.results.items():
        assert res["high_throughput_transport"] == "nvlink", (rank, res)
        if nvshmem_built():  # both runtimes were built before the kill
            assert res["low_latency_transport"] == "nvshmem", (rank, res)
            # The NVSHMEM session lost a PE (never re-initialised): the new group runs on ATen
            assert res["rebuild"]["low_latency_transport"].startswith("aten"), (rank, res)
