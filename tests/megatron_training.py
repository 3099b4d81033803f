"""Existing Megatron-Core training code, switched between backends: a tiny GPT with MoE layers
(``GPTModel``), and a small MoE model under FSDP2 (``fully_shard``), trained for a few steps.

The workers of tests/test_megatron_gpu.py (and of the CPU check of the same code in
tests/test_megatron_cpu.py) run each function twice: once with the whole job on
``init_process_group("ep")`` and the flex dispatcher (``deepep`` backend through the facade), once
on the reference backend (NCCL, or Gloo on CPU) with the alltoall dispatcher. Same seeds, same
data: the per-step losses must agree to the round-off of the dispatchers' different summation
orders (see the tests for the bound and why).

``megatron_cases.import_megatron()`` must have run in the worker first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_cases import MoeShape, moe_config

VOCAB = 128
SEQ = 16
MICRO_BATCH = 2


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's tokens and next-token labels ``[MICRO_BATCH, SEQ]`` (int64):
    counting sequences ``s, s+1, ...`` (mod ``VOCAB``) from random starts, which the model
    learns within a few steps (the loss must go down for the comparison to mean anything)."""
    g = torch.Generator().manual_seed(31 * dist.get_rank() + 1000 * step)
    starts = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_gpt(dispatcher: str, steps: int, dtype: torch.dtype, device: torch.device) -> dict:
    """A 2-layer MoE ``GPTModel`` (EP = world, TP = PP = 1, DP = world for the dense weights)
    trained ``steps`` Adam steps with Megatron's groups from ``initialize_model_parallel`` (so of
    the world's backend). Dense gradients are averaged over Megatron's data-parallel group, expert
    gradients over its expert-data-parallel group (one rank here), as Megatron's DDP does.

    Returns ``{"losses": [float] * steps, "init": float}`` (``init``: a checksum of the initial
    weights, which must not depend on the dispatcher or backend).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, expert_model_parallel_size=world
    )
    try:
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(123)
        torch.manual_seed(123)
        config = moe_config(dispatcher, world, MoeShape(), dtype)
        config.num_layers = 2
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
        model = model.to(device=device, dtype=dtype)
        init = float(sum(p.detach().double().sum() for p in model.parameters()))
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        dense = [p for p in model.parameters() if getattr(p, "allreduce", True)]
        experts = [p for p in model.parameters() if not getattr(p, "allreduce", True)]
        dp_group = parallel_state.get_data_parallel_group()
        expert_dp_group = parallel_state.get_expert_data_parallel_group()
        positions = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, -1)
        # Megatron's causal mask (True = masked), given explicitly: its default one is made on
        # "cuda" whatever the device
        causal = torch.ones(SEQ, SEQ, device=device).triu(diagonal=1).bool()[None, None]
        losses = []
        for step in range(steps):
            tokens, labels = _batch(step, device)
            opt.zero_grad(set_to_none=True)
            loss = model(tokens, positions, causal, labels=labels).float().mean()
            loss.backward()
            for params, group in ((dense, dp_group), (experts, expert_dp_group)):
                size = dist.get_world_size(group)
                for p in params:
                    if p.grad is not None and size > 1:
                        dist.all_reduce(p.grad, group=group)
                        p.grad.div_(size)
            opt.step()
            # the mean over data-parallel ranks, as Megatron logs it
            logged = loss.detach().reshape(1)
            dist.all_reduce(logged, group=dp_group)
            losses.append(float(logged) / dist.get_world_size(dp_group))
        return {"losses": losses, "init": init}
    finally:
        parallel_state.destroy_model_parallel()


class _DenseMoeDense(torch.nn.Module):
    """``Linear -> Megatron MoELayer (residual) -> Linear``: input ``[seq, batch, hidden]``."""

    def __init__(self, moe: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.moe = moe
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        m, _bias = self.moe(h)
        return self.out(h + m)


def train_fsdp2(dispatcher: str, backend: str, steps: int, dtype: torch.dtype,
                device: torch.device) -> dict:  # fmt: skip
    """A small model around Megatron's ``MoELayer`` under FSDP2 over the world's device mesh (so
    over the world's backend): each dense layer is ``fully_shard``-ed, and the root takes the
    router's weight (the router cannot be its own FSDP unit: FSDP2 swaps a module's class, and
    ``TopKRouter``'s layout refuses that); the experts (one set per rank, expert-parallel) are left
    out of FSDP (``ignored_params``).
    ``backend`` is that of the MoE layer's groups. SGD, ``steps`` steps, MSE against a fixed
    target. Returns ``{"losses": [...], "init": float}`` as ``train_gpt``.
    """
    import megatron_cases
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = MoeShape()
    moe = megatron_cases.build_moe_layer(dispatcher, backend, shape, dtype, device)
    torch.manual_seed(5)  # dense weights: the same on every rank (FSDP shards one model)
    model = _DenseMoeDense(moe, shape.hidden).to(device=device, dtype=dtype)
    init = float(sum(p.detach().double().sum() for p in model.parameters()))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=set(model.moe.experts.parameters()))
    # foreach=False: the experts stay plain tensors (outside FSDP) beside DTensor parameters,
    # and the multi-tensor kernels CUDA would use refuse the mix.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    losses = []
    for step in range(steps):
        x = megatron_cases.layer_inputs(dist.get_rank(), shape, dtype, device, step)
        target = torch.roll(x, 1, dims=-1)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
        loss.backward()
        opt.step()
        logged = loss.detach().reshape(1)
        dist.all_reduce(logged)
        losses.append(float(logged) / dist.get_world_size())
    return {"losses": losses, "init": init}
