"""A small mixture-of-experts layer trained with ep_backend's dispatch and combine.

Run it with ``python examples/moe_layer.py``: it starts 2 CPU processes itself (backend
``"ep"``), trains the layer for a few SGD steps and checks every step against a single-process
dense computation of the same layer. It prints a PASS line and exits with 0, or lists the
mismatches and exits with 1.

The layer, on each rank::

    probs          = softmax(x @ router)                 # router: replicated [H, E]
    weights, idx   = top-k(probs); weights /= sum        # slots with weight < MIN_WEIGHT: -1
    out            = dispatch(x, idx, weights)           # each token once to every rank owning
                                                         # one of its experts
    y[row]         = sum over the row's local experts le of
                     recv_weight(row, le) * (recv_x[row] @ W[le] + b[le])
    result         = combine(y, out.handle)              # [T, H], summed over the ranks

Rank ``r`` owns experts ``r * E_loc .. (r + 1) * E_loc - 1`` (their ``W`` and ``b``); the router
is replicated and its gradient is all-reduced. The loss is the mean squared error against a
target over all tokens of all ranks. Autograd runs through dispatch and combine (combine is the
backward of dispatch and vice versa), including the gradient of the routing weights.

The dense check computes, in one process, the same layer on the concatenated tokens of all ranks
with all experts local (no communication), and compares losses and gradients (float64,
relative tolerance 1e-9) at every step, then the parameters after training.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import sys
import traceback

import torch
import torch.distributed as dist

HIDDEN = 16
EXPERTS_PER_RANK = 2
TOPK = 2
MIN_WEIGHT = 0.2  # routing slots below this weight are dropped (-1), as a capacity rule might
LR = 0.5
RTOL, ATOL = 1e-9, 1e-12
DTYPE = torch.float64


def tokens_per_rank(world_size: int) -> list[int]:
    """Uneven token counts; the last rank of a 4-rank run has none."""
    return [7, 5, 9, 0][:world_size] if world_size <= 4 else [6] * world_size


def make_params(world_size: int) -> dict[str, torch.Tensor]:
    """All parameters of the layer, the same on every rank (each rank keeps its own slice)."""
    gen = torch.Generator().manual_seed(0)
    num_experts = EXPERTS_PER_RANK * world_size
    return {
        "router": torch.randn((HIDDEN, num_experts), generator=gen, dtype=DTYPE),
        "w": torch.randn((num_experts, HIDDEN, HIDDEN), generator=gen, dtype=DTYPE) / HIDDEN**0.5,
        "b": torch.randn((num_experts, HIDDEN), generator=gen, dtype=DTYPE) * 0.1,
    }


def make_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and targets of one rank (any rank can make any rank's batch).

    The same batch at every step (full-batch gradient descent), with targets from a fixed
    linear "teacher": the loss goes down step after step as the layer fits it.
    """
    del step
    gen = torch.Generator().manual_seed(rank + 1)
    num_tokens = tokens_per_rank(world_size)[rank]
    x = torch.randn((num_tokens, HIDDEN), generator=gen, dtype=DTYPE)
    teacher = torch.randn((HIDDEN, HIDDEN), generator=torch.Generator().manual_seed(7), dtype=DTYPE)
    return x, x @ (teacher / HIDDEN**0.5)


def route(x: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx int64 [T, K], topk_weights float32 [T, K])``; dropped slots are -1 / 0."""
    probs = torch.softmax(x @ router, dim=-1)
    weights, idx = probs.topk(TOPK, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    keep = weights >= MIN_WEIGHT
    idx = torch.where(keep, idx, -1)
    weights = torch.where(keep, weights, 0.0).float()  # dispatch carries float32 weights
    return idx, weights


def expert_forward(rows, idx, weights, w, b, expert_ids):
    """``sum_k weights[:, k] * (rows @ w[e] + b[e])`` over the slots whose expert is in
    ``expert_ids`` (``idx`` holds indices into ``w``/``b``, -1 for none)."""
    y = torch.zeros_like(rows)
    for e in expert_ids:
        coef = torch.where(idx == e, weights.to(rows.dtype), 0.0).sum(-1)  # [rows]
        selected = (idx == e).any(-1).nonzero().squeeze(1)
        if selected.numel() == 0:
            continue
        out = rows[selected] @ w[e] + b[e]
        y = y.index_add(0, selected, coef[selected].unsqueeze(1) * out)
    return y


# --------------------------------------------------------------------------------------------
# The distributed layer (one process per rank)
# --------------------------------------------------------------------------------------------


def distributed_step(ep, step: int, rank: int, world_size: int, params: dict[str, torch.Tensor]):
    """Forward + backward of one step; returns (global loss, the local gradients)."""
    num_experts = EXPERTS_PER_RANK * world_size
    x, target = make_batch(step, rank, world_size)
    total_tokens = sum(tokens_per_rank(world_size))
    for p in params.values():
        p.grad = None

    idx, weights = route(x, params["router"])
    out = ep.dispatch(x, idx, weights, num_experts)
    # recv_topk_idx holds local expert ids (-1 for experts of other ranks).
    local = range(EXPERTS_PER_RANK)
    y = expert_forward(
        out.recv_x, out.recv_topk_idx, out.recv_topk_weights, params["w"], params["b"], local
    )
    result = ep.combine(y, out.handle).combined_x
    loss = ((result - target) ** 2).sum() / (total_tokens * HIDDEN)
    loss.backward()

    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    dist.all_reduce(params["router"].grad)  # replicated: sum the contributions of all ranks
    return float(global_loss), {name: p.grad.clone() for name, p in params.items()}


def worker(rank: int, world_size: int, port: int, steps: int, queue) -> None:
    try:
        import ep_backend as ep

        torch.set_num_threads(1)  # ranks share the machine's cores
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(
            "ep", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        all_params = make_params(world_size)
        lo, hi = rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK
        params = {
            "router": all_params["router"].clone().requires_grad_(),
            "w": all_params["w"][lo:hi].clone().requires_grad_(),
            "b": all_params["b"][lo:hi].clone().requires_grad_(),
        }
        dense = DenseLayer(world_size)
        problems: list[str] = []
        losses: list[float] = []
        for step in range(steps):
            loss, grads = distributed_step(ep, step, rank, world_size, params)
            dense_loss, dense_grads = dense.step(step)
            losses.append(loss)
            problems += compare(f"step {step} loss", torch.tensor(loss), torch.tensor(dense_loss))
            problems += compare(f"step {step} router grad", grads["router"], dense_grads["router"])
            problems += compare(f"step {step} expert W grad", grads["w"], dense_grads["w"][lo:hi])
            problems += compare(f"step {step} expert b grad", grads["b"], dense_grads["b"][lo:hi])
            with torch.no_grad():  # SGD
                for p in params.values():
                    p -= LR * p.grad
            dense.sgd()
        problems += compare("final router", params["router"], dense.params["router"])
        problems += compare("final W", params["w"], dense.params["w"][lo:hi])
        problems += compare("final b", params["b"], dense.params["b"][lo:hi])
        queue.put((rank, losses, problems))
    except BaseException:
        queue.put((rank, [], [traceback.format_exc()]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The dense single-process reference
# --------------------------------------------------------------------------------------------


class DenseLayer:
    """The same layer on the concatenated tokens of all ranks, all experts local."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.params = {k: v.clone().requires_grad_() for k, v in make_params(world_size).items()}

    def step(self, step: int) -> tuple[float, dict[str, torch.Tensor]]:
        batches = [make_batch(step, r, self.world_size) for r in range(self.world_size)]
        x = torch.cat([b[0] for b in batches])
        target = torch.cat([b[1] for b in batches])
        for p in self.params.values():
            p.grad = None
        idx, weights = route(x, self.params["router"])
        num_experts = self.params["w"].shape[0]
        y = expert_forward(x, idx, weights, self.params["w"], self.params["b"], range(num_experts))
        loss = ((y - target) ** 2).sum() / (x.shape[0] * HIDDEN)
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in self.params.items()}

    def sgd(self) -> None:
        with torch.no_grad():
            for p in self.params.values():
                p -= LR * p.grad


def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    got, want = got.detach(), want.detach()
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        diff = (got - want).abs().max().item()
        return [f"{what}: max abs difference {diff:.3e} (rtol {RTOL}, atol {ATOL})"]
    return []


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    store = dist.TCPStore(  # the workers meet here; port 0: the OS picks a free one
        "127.0.0.1", 0, args.world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=args.timeout),
    )  # fmt: skip
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.world_size, store.port, args.steps, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, losses, problems = queue.get(timeout=args.timeout)
            results[rank] = (losses, problems)
    except Exception as exc:  # queue.Empty: a worker hung or died
        print(f"FAIL: no result from every rank ({type(exc).__name__})", file=sys.stderr)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if len(results) != args.world_size:
        return 1

    failures = [
        f"rank {r}: {msg}" for r, (_, problems) in sorted(results.items()) for msg in problems
    ]
    losses = results[0][0]
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.10f}")
    if failures:
        print("FAIL: the distributed layer differs from the dense computation:")
        for line in failures:
            print("  " + line)
        return 1
    if not losses or not losses[-1] < losses[0]:
        print(f"FAIL: the loss did not decrease: {losses}")
        return 1
    print(
        f"PASS: {args.world_size} ranks, {args.steps} SGD steps: losses, gradients and parameters "
        f"match the dense single-process layer (rtol {RTOL}); loss {losses[0]:.6f} -> "
        f"{losses[-1]:.6f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
