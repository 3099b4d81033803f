"""Users' training code runs unchanged on "ep": DDP and FSDP2 match the same run on Gloo."""

from __future__ import annotations

import pytest
import torch
from _dist_utils import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def _train(model: torch.nn.Module, rank: int, steps: int = 5) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in _batches(rank, steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ddp(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    losses = _train(model, rank)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def _fsdp2(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _train(model, rank)
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("trainer", [_ddp, _fsdp2], ids=["ddp", "fsdp2"])
def test_training_matches_gloo_exactly(trainer) -> None:
    ep = run_distributed(trainer, 2, backend="ep")
    gloo = run_distributed(trainer, 2, backend="gloo")
    for rank in range(2):
        assert ep[rank]["losses"] == gloo[rank]["losses"]
        for a, b in zip(ep[rank]["params"], gloo[rank]["params"], strict=True):
            assert torch.equal(a, b)
    # training moved the parameters, and ranks agree (the gradients were really reduced)
    start = [p.detach() for p in _model().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(ep[0]["params"], start, strict=True))
    for a, b in zip(ep[0]["params"], ep[1]["params"], strict=True):
        assert torch.equal(a, b)
