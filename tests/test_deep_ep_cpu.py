"""``ep_backend.deep_ep`` on CPU ranks: DeepEP-style code after ``install()``, and its errors.

The workers start a Gloo world (as vLLM's CPU group) or an ``"ep"`` world; the facade runs on
an ``"ep"`` group over the same ranks. The cases are in ``deep_ep_cases.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _dist_utils import run_distributed

import ep_backend.deep_ep as facade

TIMEOUT = 180.0


def _cases_worker(rank: int, world: int, seed: int) -> str:
    torch.set_num_threads(1)
    facade.install()
    import deep_ep_cases

    device = torch.device("cpu")
    deep_ep_cases.case_normal(rank, world, device, seed)
    deep_ep_cases.case_low_latency(rank, world, device, seed)
    return dist.get_backend(facade.Buffer(dist.group.WORLD).ep_group)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["gloo", "ep"])
def test_deepep_code_runs_unchanged(world: int, backend: str) -> None:
    if backend == "ep" and world == 4:
        pytest.skip("the ep world is covered at 2 ranks; 4 ranks run on a Gloo world")
    results = run_distributed(_cases_worker, world, 11 + world, backend=backend, timeout=TIMEOUT)
    assert results == ["ep"] * world


def _errors_worker(rank: int, world: int) -> list[str]:
    """Each bad call raises on every rank (same bad input everywhere); then a good call works."""
    torch.set_num_threads(1)
    facade.install()
    import deep_ep
    import deep_ep_cases

    raised: list[str] = []

    def expect(exc: type[BaseException], fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except exc as e:
            raised.append(f"{exc.__name__}: {e}")
            return
        raise AssertionError(f"rank {rank}: {fn.__name__} did not raise {exc.__name__}")

    buffer = deep_ep.Buffer(dist.group.WORLD)
    x, idx, w, experts = deep_ep_cases.routing(rank, world, 3, torch.device("cpu"))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    expect(TypeError, deep_ep.Buffer, dist.group.WORLD, use_nvfp4=True)
    expect(RuntimeError, buffer.low_latency_clean_mask_buffer)  # needs enable_shrink=True
    expect(NotImplementedError, deep_ep.Buffer, dist.group.WORLD, comm=object())
    expect(NotImplementedError, deep_ep.Buffer, None, allow_nvlink_for_low_latency_mode=False)
    expect(TypeError, buffer.dispatch, x, topk_idx=idx, num_tokens_per_rank=per_rank,
           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, x_global_scale=1.0)  # fmt: skip
    expect(ValueError, buffer.dispatch, x, topk_idx=idx, num_tokens_per_expert=per_expert)
    expect(ValueError, buffer.dispatch, x, topk_idx=idx, num_tokens_per_rank=per_rank,
           is_token_in_rank=in_rank[:, :1], num_tokens_per_expert=per_expert)  # fmt: skip
    expect(ValueError, buffer.get_dispatch_layout, idx, experts, allocate_on_comm_stream=True)
    expect(TypeError, buffer.get_dispatch_layout, idx, experts, previous_event=object())
    expect(TypeError, buffer.combine, x, handle=(1, 2, 3))
    expect(TypeError, deep_ep.Config, 3.5)
    expect(ValueError, deep_ep.Config, 21)
    expect(ValueError, deep_ep.Buffer.set_num_sms, 7)
    expect(RuntimeError, buffer.low_latency_dispatch, x, idx, 16, experts)
    expect(RuntimeError, deep_ep.EventOverlap().current_stream_wait)
    expect(NotImplementedError, buffer.get_local_buffer_tensor, torch.bfloat16)
    expect(RuntimeError, buffer.destroy)

    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                          is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)  # fmt: skip
    handle = out[4]
    expect(NotImplementedError, lambda: handle[1].shape)
    expect(IndexError, lambda: handle[6])
    expect(ValueError, buffer.dispatch, x, handle=handle, topk_idx=idx)

    ll = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    xl, il, wl, el = deep_ep_cases.routing(
        rank, world, 4, torch.device("cpu"), num_tokens=4, hidden=128
    )
    stats = torch.zeros(world, dtype=torch.int64)
    expect(
        NotImplementedError,
        ll.low_latency_dispatch,
        xl,
        il,
        8,
        el,
        dispatch_wait_recv_cost_stats=stats,
    )
    expect(
        ValueError, ll.low_latency_dispatch, xl, il, 8, el, async_finish=True, return_recv_hook=True
    )
    expect(TypeError, ll.low_latency_dispatch, xl, il, 8, el, use_nvfp4=True)
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(xl, il, 8, el, use_fp8=False)
    expect(ValueError, ll.low_latency_combine, recv, il, wl, ll_handle, zero_copy=True)
    expect(
        ValueError, ll.low_latency_combine, recv, il, wl, ll_handle, zero_copy=True, use_logfmt=True
    )
    expect(NotImplementedError, ll.low_latency_combine, recv, il, wl, ll_handle,
           combine_wait_recv_cost_stats=stats)  # fmt: skip
    expect(TypeError, ll.low_latency_combine, recv, il, wl, ll_handle, overlap=True)
    # ep's own validation raises on every rank, and the next call is unaffected.
    bad = idx.clone()
    if bad.numel():
        bad[0, 0] = experts + 5
    expect(RuntimeError, buffer.dispatch, x, topk_idx=bad, num_tokens_per_rank=per_rank,
           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)  # fmt: skip
    again = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)  # fmt: skip
    assert torch.equal(again[0], out[0])
    ll.destroy()
    expect(RuntimeError, ll.low_latency_dispatch, xl, il, 8, el)
    return raised


def test_errors_raise_clearly() -> None:
    results = run_distributed(_errors_worker, 2, backend="gloo", timeout=TIMEOUT)
    for messages in results:
        assert all("Error" in m for m in messages)
        assert any("x_global_scale" in m for m in messages)
        assert any("dispatch_wait_recv_cost_stats" in m for m in messages)


def test_install_puts_facade_in_sys_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.delitem(sys.modules, "deep_ep.utils", raising=False)
    assert facade.install() is facade
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap

    assert deep_ep is facade and EventHandle is facade.EventHandle
    assert EventOverlap is facade.EventOverlap and deep_ep.topk_idx_t is torch.int64
    assert facade.install() is facade  # idempotent
    facade.uninstall()
    assert "deep_ep" not in sys.modules and "deep_ep.utils" not in sys.modules


def test_install_refuses_to_shadow_real_deepep(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.delitem(sys.modules, "deep_ep.utils", raising=False)
    with pytest.raises(RuntimeError, match="refusing to shadow"):
        facade.install()
    assert facade.install(force=True) is facade
    facade.uninstall()


def _shim_env(extra_path: str | None = None) -> dict[str, str]:
    paths = [facade.shim_path()] + ([extra_path] if extra_path else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + sys.path[1:])}


def test_shim_reaches_spawned_processes(tmp_path) -> None:
    code = (
        "import importlib.util, sys; assert importlib.util.find_spec('deep_ep') is not None; "
        "import deep_ep, deep_ep.utils; from deep_ep import Buffer; "
        "import ep_backend.deep_ep as f; assert deep_ep is f and sys.modules['deep_ep.utils'] is f.utils; "
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_shim_env(), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    # With a real DeepEP importable, the shim refuses unless forced.
    real = tmp_path / "deep_ep"
    real.mkdir()
    (real / "__init__.py").write_text("")
    out = subprocess.run([sys.executable, "-c", "import deep_ep"], env=_shim_env(str(tmp_path)),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "refusing to shadow" in out.stderr
    env = {**_shim_env(str(tmp_path)), "EP_DEEP_EP_FORCE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_module_contents_and_static_methods() -> None:
    import ep_backend.deep_ep.utils as utils

    assert {"Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "utils"} <= set(
        dir(facade)
    )
    assert utils.EventHandle is facade.EventHandle
    assert facade.Buffer.is_sm90_compiled() is True
    assert isinstance(facade.Buffer.get_dispatch_config(8), facade.Config)
    config = facade.Buffer.get_combine_config(4)
    assert config.get_nvl_buffer_size_hint(7168 * 2, 4) > 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 4) == 0
    assert config.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    hint = facade.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    assert hint % 128 == 0 and 1.5e9 < hint < 3e9  # DeepEP's layout at its test shape: ~2.1 GB
    old = facade.Buffer.num_sms
    try:
        facade.Buffer.set_num_sms(24)
        assert facade.Buffer.get_dispatch_config(2).num_sms == 24
    finally:
        facade.Buffer.set_num_sms(old)
    with facade.Buffer.capture() as ev:
        assert isinstance(ev, facade.EventOverlap)
