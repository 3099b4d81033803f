"""Megatron-Core's own ``MoELayer`` on ``ep`` (flex dispatcher, ``deepep`` backend, through the
``deep_ep`` facade) and on a reference group (``alltoall`` dispatcher on Gloo or NCCL).

Shared by tests/test_megatron_cpu.py, tests/test_megatron_gpu.py and
benchmarks/megatron_moe_step.py. Every function here runs inside a worker of an initialised
process group; ``import_megatron()`` must come before any other Megatron import (it installs the
facade as ``deep_ep`` first: Megatron binds ``HAVE_DEEP_EP`` when its ``fused_a2a`` module is
imported, and, on CPU, the ``torch.cuda`` stand-ins of ``megatron_cpu_shim``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MEGATRON_SKIP_REASON = (
    "megatron-core is not installed (CI installs it: `pip install --no-deps "
    "--ignore-requires-python megatron-core==0.19.2 einops triton`, see .ci/run)"
)


def megatron_installed() -> bool:
    """Whether ``megatron.core`` is importable (checked without importing it)."""
    return importlib.util.find_spec("megatron") is not None and (
        importlib.util.find_spec("megatron.core") is not None
    )


def import_megatron() -> None:
    """Installs the ``deep_ep`` facade (and, without CUDA, the test's ``torch.cuda`` stand-ins),
    then imports Megatron-Core's MoE modules; checks that Megatron picked up the facade."""
    import ep_backend.deep_ep

    ep_backend.deep_ep.install()
    shim = None
    if not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import megatron_cpu_shim as shim

        shim.install()
    os.environ.setdefault("MEGATRON_LOGGING_LEVEL", "40")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.transformer.moe import fused_a2a, token_dispatcher  # noqa: F401

    if shim is not None:
        shim.patch_megatron()

    if not fused_a2a.HAVE_DEEP_EP or fused_a2a.Buffer is not ep_backend.deep_ep.Buffer:
        raise AssertionError("Megatron did not bind the ep deep_ep facade as its DeepEP")


@dataclass(frozen=True)
class MoeShape:
    """Sizes of the MoE layer and its input (per rank: ``seq * batch`` tokens of ``hidden``)."""

    hidden: int = 64
    ffn_hidden: int = 96
    experts_per_rank: int = 2
    topk: int = 2  # two terms per token: their sum has the same bits in either order
    seq: int = 8
    batch: int = 2


def process_groups(backend: str) -> Any:
    """A Megatron ``ProcessGroupCollection`` for pure expert parallelism over the whole world.

    Every group is new and of ``backend`` (collective over all ranks): ``ep`` and ``tp_ep`` are
    the world; ``tp``, ``cp``, ``expt_tp``, ``expt_dp``, ``tp_cp`` and ``dp`` are one-rank groups
    (no tensor, context or data parallelism); ``tp_dp_cp`` is the world.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.new_group(backend=backend)
    single, _ = dist.new_subgroups(group_size=1, backend=backend)
    return ProcessGroupCollection(
        tp=single, cp=single, tp_cp=single, expt_tp=single, expt_dp=single, dp=single,
        dp_cp=single, pp=single, ep=world, tp_ep=world, tp_dp_cp=world,
    )  # fmt: skip


def moe_config(dispatcher: str, world: int, shape: MoeShape, dtype: torch.dtype) -> Any:
    """Megatron's ``TransformerConfig`` for one MoE layer with ``dispatcher`` ("flex" on the
    ``deepep`` backend, or "alltoall"), top-k softmax routing in FP32, no load-balancing loss
    (it would add a group collective that is not under test), no dropping."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn_hidden,
        moe_ffn_hidden_size=shape.ffn_hidden,
        num_attention_heads=4,
        hidden_dropout=0.0,  # deterministic: the two runs of each comparison draw no numbers
        attention_dropout=0.0,
        num_moe_experts=shape.experts_per_rank * world,
        moe_router_topk=shape.topk,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_flex_dispatcher_backend="deepep",
        moe_permute_fusion=False,
        moe_grouped_gemm=False,
        expert_model_parallel_size=world,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
    )


def build_moe_layer(dispatcher: str, backend: str, shape: MoeShape, dtype: torch.dtype,
                    device: torch.device) -> torch.nn.Module:  # fmt: skip
    """Megatron's ``MoELayer`` (local ``SequentialMLP`` experts) on new groups of ``backend``,
    with weights drawn from seed 1234 + rank (the same for every call on a rank)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    world = dist.get_world_size()
    config = moe_config(dispatcher, world, shape, dtype)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    torch.manual_seed(1234 + dist.get_rank())
    # the spec's MLP builder: MoELayer with local SequentialMLP experts and a TopKRouter
    layer = spec.submodules.mlp(config=config, pg_collection=process_groups(backend))
    return layer.to(device=device, dtype=dtype)


def layer_inputs(rank: int, shape: MoeShape, dtype: torch.dtype, device: torch.device,
                 step: int = 0) -> torch.Tensor:  # fmt: skip
    """This rank's input ``[seq, batch, hidden]`` (different on every rank and step)."""
    g = torch.Generator().manual_seed(7 * rank + 1000 * step + 1)
    x = torch.randn(shape.seq, shape.batch, shape.hidden, generator=g)
    return x.to(device=device, dtype=dtype)


def forward_backward(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward and backward of ``layer`` on ``x`` with the loss ``sum(out * w)`` for a fixed
    ``w``; returns the output, the input gradient and the weight gradients, on the CPU."""
    x = x.detach().clone().requires_grad_(True)
    out, _bias = layer(x)
    g = torch.Generator().manual_seed(99)
    weight = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    (out * weight).sum().backward()
    result = {"output": out.detach().cpu(), "input_grad": x.grad.detach().cpu()}
    for name, p in layer.named_parameters():
        result["grad." + name] = p.grad.detach().cpu()
        p.grad = None
    return result


def check_setup(setup: dict, reference_backend: str) -> None:
    """What ``flex_vs_alltoall`` ran is what the comparison claims."""
    assert setup["facade_group_backend"] == "ep", setup
    assert setup["dispatchers"] == ("MoEFlexTokenDispatcher", "MoEAlltoAllTokenDispatcher"), setup
    assert setup["reference_backend"] == reference_backend, setup


def flex_vs_alltoall(reference_backend: str, shape: MoeShape, dtype: torch.dtype,
                     device: torch.device) -> dict[str, dict[str, torch.Tensor]]:  # fmt: skip
    """The same MoE layer step with the flex dispatcher on an ``"ep"`` group (through the facade)
    and with the alltoall dispatcher on a ``reference_backend`` group, on the same weights and
    inputs. Returns ``{"flex": ..., "alltoall": ..., "setup": ...}``: the ``forward_backward``
    results, and what ran (the backend of the facade's group, the dispatcher classes, the
    backend of the alltoall dispatcher's group)."""
    import ep_backend.deep_ep

    flex = build_moe_layer("flex", "ep", shape, dtype, device)
    alltoall = build_moe_layer("alltoall", reference_backend, shape, dtype, device)
    alltoall.load_state_dict(flex.state_dict())
    x = layer_inputs(dist.get_rank(), shape, dtype, device)
    results = {"flex": forward_backward(flex, x), "alltoall": forward_backward(alltoall, x)}
    ep_group = flex.token_dispatcher._comm_manager.group
    buffer = ep_backend.deep_ep.Buffer(ep_group)
    results["setup"] = {  # type: ignore[dict-item]
        "facade_group_backend": dist.get_backend(buffer.ep_group),
        "dispatchers": (
            type(flex.token_dispatcher).__name__,
            type(alltoall.token_dispatcher).__name__,
        ),  # fmt: skip
        "reference_backend": dist.get_backend(alltoall.token_dispatcher.ep_group),
    }
    return results


def alltoall_on_ep_vs_reference(reference_backend: str, shape: MoeShape, dtype: torch.dtype,
                                device: torch.device) -> dict[str, Any]:  # fmt: skip
    """The same MoE layer step with Megatron's ``alltoall`` dispatcher on an ``"ep"`` group and on
    a ``reference_backend`` group, on the same weights and inputs. Its token exchanges are
    ``all_to_all_single`` calls (copies), so the two results must have the same bits. Returns
    ``{"ep": ..., "reference": ..., "setup": ...}`` with the ``forward_backward`` results and what
    ran (each group's backend, and on the ``"ep"`` group the all-to-all transport)."""
    import ep_backend

    on_ep = build_moe_layer("alltoall", "ep", shape, dtype, device)
    reference = build_moe_layer("alltoall", reference_backend, shape, dtype, device)
    reference.load_state_dict(on_ep.state_dict())
    x = layer_inputs(dist.get_rank(), shape, dtype, device)
    results: dict[str, Any] = {"ep": forward_backward(on_ep, x),
                               "reference": forward_backward(reference, x)}  # fmt: skip
    ep_group = on_ep.token_dispatcher.ep_group
    results["setup"] = {
        "ep_backend": dist.get_backend(ep_group),
        "reference_backend": dist.get_backend(reference.token_dispatcher.ep_group),
        "all_to_all_transport": ep_backend.get_backend(ep_group).all_to_all_transport,
    }
    return results
