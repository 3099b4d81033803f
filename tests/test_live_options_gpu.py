"""``Options`` fields set on a live group's ``get_backend().options`` take effect at the next call.

``num_sms`` is read from the grid of the dispatch and combine kernels in a profiler trace;
``recv_slabs`` from whether dispatch outputs are views of a receive slab; every call is compared
with ``reference.py``.
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import gpu_world_size, run_distributed
from moe_helpers import cuda_routing, kernel_grids

pytestmark = pytest.mark.gpu(min_gpus=2)

H, K, E = 1024, 8, 64


def _calls_with(rank: int, world: int, num_sms_values: list[int]) -> list[str]:
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    failures: list[str] = []
    opts = dist.group.WORLD._get_backend(torch.device("cuda")).options
    for step, num_sms in enumerate(num_sms_values):
        opts.num_sms = num_sms
        x, idx, w = cuda_routing(256, H, E, K, seed=step * 97 + rank)

        def calls(x: torch.Tensor = x, idx: torch.Tensor = idx, w: torch.Tensor = w) -> tuple:
            out = ep.dispatch(x, idx, w, E)
            y = out.recv_x * 2
            return out, y, ep.combine(y, out.handle, out.recv_topk_weights)

        (out, y, comb), grids = kernel_grids(
            calls, ("dispatch", "combine"), lambda name: "nvlink" in name.lower()
        )
        for key in ("dispatch", "combine"):
            if grids.get(key) != {num_sms}:
                failures.append(f"rank {rank} num_sms={num_sms}: {key} grids {grids.get(key)}")
        expected = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
        if not torch.equal(out.recv_x.cpu(), expected.recv_x):
            failures.append(f"rank {rank} num_sms={num_sms}: recv_x differs from the spec")
        exp_comb = ref.combine(y.cpu(), expected.handle, expected.recv_topk_weights)
        if not torch.equal(comb.combined_x.cpu(), exp_comb.combined_x):
            failures.append(f"rank {rank} num_sms={num_sms}: combine differs from the spec")
    return failures


def test_num_sms_set_on_a_live_group_changes_the_next_calls_grid() -> None:
    res = run_distributed(_calls_with, gpu_world_size(), [24, 8, 32, 24], backend="ep", timeout=300)
    failures = [f for r in res for f in r]
    assert not failures, "\n".join(failures[:20])


def _is_slab_view(t: torch.Tensor) -> bool:
    import ep_backend as ep

    stream = torch.cuda.current_stream()  # the op's own stream: recording it changes nothing
    return ep._C._record_slab_stream(t, stream.stream_id, stream.device_index, stream.device_type)


def _slabs_then_none(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import ep_backend as ep
    from ep_backend import reference as ref

    failures: list[str] = []
    opts = dist.group.WORLD._get_backend(torch.device("cuda")).options
    for step, slabs in enumerate([2, 0, 2]):
        opts.recv_slabs = slabs
        x, idx, w = cuda_routing(256, H, E, K, seed=step * 13 + rank)
        out = ep.dispatch(x, idx, w, E)
        torch.cuda.synchronize()
        expected = ref.dispatch(x.cpu(), idx.cpu(), w.cpu(), E)
        if not torch.equal(out.recv_x.cpu(), expected.recv_x):
            failures.append(f"rank {rank} recv_slabs={slabs}: recv_x differs from the spec")
        viewed = _is_slab_view(out.recv_x)
        if viewed != (slabs > 0):
            failures.append(f"rank {rank} recv_slabs={slabs}: outputs are slab views: {viewed}")
        del out
    return failures


def test_recv_slabs_set_on_a_live_group_takes_effect() -> None:
    res = run_distributed(_slabs_then_none, gpu_world_size(), backend="ep", timeout=300)
    failures = [f for r in res for f in r]
    assert not failures, "\n".join(failures[:20])
