"""The warning, once per group, that its MoE ops on CUDA tensors run on ATen, not ep's kernels."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._groups import EPProcessGroup, get_backend


class FallbackWarning(UserWarning):
    """A group's MoE ops on CUDA tensors run on ATen + NCCL, not on ep's kernels (said once)."""


_FALLBACK_COST = {
    "high_throughput": "the NVLink kernels",
    "low_latency": "the NVSHMEM kernels (the ATen path is correct, but neither low-latency nor "
    "CUDA-graph capturable)",
    "all_to_all": "the NVLink all-to-all kernel (the NCCL path syncs the host for device splits)",
}


def _transport_verdict(backend: EPProcessGroup, kind: str) -> tuple[bool, str | None]:
    """The backend's choice of transport for its ``kind`` ops: ``(decided, why)``.

    ``why`` is the reason the ops fell back to ATen without being asked to, else ``None`` (they
    run on ep's kernels, or ``EP_HIGH_THROUGHPUT=aten`` / ``EP_LOW_LATENCY=aten`` asked for
    ATen). Reads the backend's ``TransportChoice`` (kind, reason, requested).
    """
    choice = getattr(backend, f"{kind}_transport_choice")
    if choice.kind.name == "undecided":
        return False, None
    if choice.kind.name != "aten" or choice.requested:
        return True, None
    return True, choice.reason


def _check_fallback(pg: dist.ProcessGroup, pending: set[str], kind: str, on_cuda: bool) -> None:
    """Warns once per group if its ``kind`` ops on CUDA tensors fell back to ATen.

    The op decides the transport (collectively) at the group's first call on CUDA tensors; this
    reads its verdict once, after that call. No warning where the fallback was asked for
    (``EP_HIGH_THROUGHPUT=aten`` / ``EP_LOW_LATENCY=aten``). ``pending``: from ``_group_state``.
    """
    if not on_cuda or kind not in pending:
        return
    if torch.compiler.is_compiling():
        return
    decided, why = _transport_verdict(get_backend(pg), kind)
    if not decided:
        return
    pending.discard(kind)
    if why is None:
        return
    import warnings

    warnings.warn(
        f"ep: the {kind.replace('_', '-')} MoE ops of group {pg.group_name!r} run on ATen + "
        f"NCCL, not on {_FALLBACK_COST[kind]}: {why}. (EPProcessGroup.{kind}_transport; "
        f"EP_{kind.upper()}=aten asks for this without a warning.)",
        FallbackWarning,
        stacklevel=3,
    )
