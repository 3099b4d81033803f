"""``Buffer``: DeepEP V1's legacy ``deep_ep.Buffer`` API on ``ep``'s MoE collectives.

Every method keeps DeepEP's name, arguments, defaults, return tuple and dtypes, and runs on the
public ``ep_backend`` functions of an ``"ep"`` group over the buffer's ranks. What ``ep`` cannot
honour raises (``TypeError`` for keywords DeepEP V1 does not have, ``NotImplementedError`` for
features ``ep`` lacks); nothing is accepted and then ignored, except sizes and tuning hints
``ep`` replaces with its own (each docstring says which).

Notation: ``T`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks,
``E_loc = E / R``, ``N`` received rows, ``M`` = ``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ep_backend

from . import logfmt
from .config import Config
from .groups import ep_group_for
from .handles import IntranodeHandle, LowLatencyHandle
from .streams import CommStreams, check_flags
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer"]

_NVL_PEERS_PER_NODE = 8
_MAX_TOPK = 32  # ep's top-k limit, which bounds dispatch without topk_idx (one slot per rank)

# Buffers not yet destroyed. Rank masking belongs to the "ep" group, which the Buffers on the
# same ranks share (groups.ep_group_for): a Buffer with enable_shrink and one without cannot live
# on one group at once. Weak: a Buffer dropped without destroy() leaves it.
_open_buffers: weakref.WeakSet[Buffer] = weakref.WeakSet()
# The "ep" groups whose auto-masking a Buffer(enable_shrink=True) turned on. Weak, so a
# collected group leaves it (an id could be reused by a later group).
_facade_auto_mask: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def _open_on(ep_group: dist.ProcessGroup) -> list[Buffer]:
    """The open Buffers on ``ep_group``. A Buffer dropped in a reference cycle leaves the weak set
    only when the cycle collector runs, at a different moment on each rank: collected first, so
    every rank sees the same Buffers (this runs only at a Buffer's creation and destroy())."""
    gc.collect()
    return [b for b in _open_buffers if b.ep_group is ep_group]


def _masking_off(ep_group: dist.ProcessGroup) -> None:
    """Auto-masking off and every rank unmasked: the group's next low-latency call waits for
    every rank again (a Buffer without enable_shrink fails on a missing peer, never skips it)."""
    ep_backend.low_latency_auto_mask(None, group=ep_group)
    ep_backend.low_latency_clean_mask(group=ep_group)
    _facade_auto_mask.discard(ep_group)


def _reject_keywords(method: str, keywords: dict[str, Any]) -> None:
    if keywords:
        names = ", ".join(sorted(keywords))
        raise TypeError(
            f"deep_ep (ep): Buffer.{method}() got keyword(s) {names} that DeepEP V1's API does "
            "not have (a fork's extension?); ep cannot honour them"
        )


def _require_int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _require_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _require_tensor(value: Any, name: str, dim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {list(value.shape)}")
    return value


def _split_x(x: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeepEP's ``x``: a tensor ``[T, H]``, or the FP8 tuple ``(x_fp8 [T, H], scales [T, S])``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError("FP8 x must be the tuple (x_fp8, scales)")
        data = _require_tensor(x[0], "x[0]", dim=2)
        scales = _require_tensor(x[1], "x[1] (scales)", dim=2)
        if scales.shape[0] != data.shape[0]:
            raise ValueError(
                f"scales must have one row per token: x {list(data.shape)}, scales "
                f"{list(scales.shape)}"
            )
        return data, scales
    return _require_tensor(x, "x", dim=2), None


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """Storage for ``t`` ``[E, S, C]`` laid out column-major in its last two dims (DeepEP's)."""
    if t.stride(-2) == 1:
        return t
    return t.new_empty((t.shape[0], t.shape[2], t.shape[1])).transpose(1, 2)


def _no_op_hook() -> None:
    """The receive hook of a low-latency combine: ep's combine is complete when it returns."""


class Buffer:
    """DeepEP V1's ``Buffer`` (normal and low-latency modes) running on ``ep``.

    Args:
        group: any process group over the participating ranks (NCCL, Gloo or ``"ep"``; default
            WORLD). An ``"ep"`` group is used as is; for any other, an ``"ep"`` group over the
            same global ranks is created by the first ``Buffer`` on those ranks (collective
            over them) and shared by later ones.
        num_nvl_bytes: DeepEP's NVLink buffer size. Kept as the attribute (callers compare it
            with their size hints); ``ep`` sizes its NVLink transport from the shapes it sees.
        num_rdma_bytes: likewise for DeepEP's RDMA buffer (``ep`` sizes its NVSHMEM buffers).
        low_latency_mode: allow the low-latency methods (DeepEP requires it for them).
        num_qps_per_rank: DeepEP's NVSHMEM queue pairs per peer; ``ep`` chooses its own.
        allow_nvlink_for_low_latency_mode: must be True (ep always uses NVLink within a node).
        allow_mnnvl: permission for multi-node NVLink; ep runs within one node, so it has
            nothing to enable.
        use_fabric: must be False (fabric memory handles: not in ep).
        explicitly_destroy: ``destroy()`` must then be called (and is allowed only then).
        enable_shrink: allow rank masking (``low_latency_*_mask_buffer``), and mask a peer
            that misses a low-latency call for the group's ``kernel_timeout_s`` instead of
            failing the call (``ep_backend.low_latency_auto_mask``; the spec is
            ``ep_backend.reference.low_latency_dispatch`` with ``mask``). Masking is a property
            of the ranks' shared ``"ep"`` group: Buffers on the same ranks must agree on it
            while they are open; the last one with it turns auto-masking off at ``destroy()``.
        comm: must be None (mpi4py bootstrap is not in ep; ep bootstraps through the group).

    Attributes:
        rank, group, group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
        explicitly_destroy: as in DeepEP (``group`` is the group given).
        ep_group: the ``"ep"`` process group the ops run on.
        num_sms: class attribute, SMs of the high-throughput kernels (``set_num_sms``).

    Raises:
        NotImplementedError: for the options above that ep cannot honour.
        TypeError: for arguments of the wrong type.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        **unsupported: Any,
    ) -> None:
        _reject_keywords("__init__", unsupported)
        self.num_nvl_bytes = _require_int(num_nvl_bytes, "num_nvl_bytes")
        self.num_rdma_bytes = _require_int(num_rdma_bytes, "num_rdma_bytes")
        self.low_latency_mode = _require_bool(low_latency_mode, "low_latency_mode")
        self.num_qps_per_rank = _require_int(num_qps_per_rank, "num_qps_per_rank", 1)
        self.explicitly_destroy = _require_bool(explicitly_destroy, "explicitly_destroy")
        _require_bool(allow_mnnvl, "allow_mnnvl")
        if not _require_bool(
            allow_nvlink_for_low_latency_mode, "allow_nvlink_for_low_latency_mode"
        ):
            raise NotImplementedError(
                "deep_ep (ep): allow_nvlink_for_low_latency_mode=False (forcing RDMA between "
                "GPUs of one node) is not available in ep"
            )
        if _require_bool(use_fabric, "use_fabric"):
            raise NotImplementedError("deep_ep (ep): use_fabric=True is not available in ep")
        self.enable_shrink = _require_bool(enable_shrink, "enable_shrink")
        if comm is not None:
            raise NotImplementedError(
                "deep_ep (ep): comm= (mpi4py bootstrap) is not available; pass a process group"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.ep_group = ep_group_for(group, Buffer.num_sms)
        self._num_nodes = ep_backend.topology(self.ep_group).num_nodes
        self.rank = dist.get_rank(self.ep_group)
        self.group_size = self.ep_group.size()
        self._backend = ep_backend.get_backend(self.ep_group)
        if self._backend.high_throughput_transport == "undecided":  # a group given as "ep"
            self._backend.options.num_sms = Buffer.num_sms
        self._streams = CommStreams()
        if torch.cuda.is_available():
            # Made now, as DeepEP makes its own: torch's first stream taken from its pool on a
            # device holds the host until that device's queued work has ended.
            self._streams.get()
        self._set_up_masking()
        # The last get_dispatch_layout: (its ep layout, weak ref to topk_idx, topk_idx version).
        self._last_layout: tuple[ep_backend.DispatchLayout, weakref.ref, int | None] | None = None
        self._destroyed = False

    # ----------------------------------------------------------------------------------------
    # Static methods
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 dispatch (what DeepEP gates on SM90 features) works on every ep build."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs (blocks) of ep's high-throughput dispatch and combine kernels.

        Applies to every ``Buffer``'s next call through the default configs; an ``"ep"`` group
        fixes its count when its NVLink transport is built (its first dispatch on CUDA), so set
        it before then, as DeepEP's users do.

        Raises:
            TypeError / ValueError: not a positive even int (DeepEP uses ``num_sms / 2``
                channels).
        """
        _require_int(new_num_sms, "new_num_sms", 1)
        if new_num_sms % 2 != 0:
            raise ValueError(f"num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` on an event recorded on the current stream now."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The dispatch ``Config`` for ``num_ranks`` ranks: ``Buffer.num_sms`` SMs (any R)."""
        _require_int(num_ranks, "num_ranks", 1)
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The combine ``Config`` for ``num_ranks`` ranks: ``Buffer.num_sms`` SMs (any R)."""
        _require_int(num_ranks, "num_ranks", 1)
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes DeepEP's double-buffered low-latency layout takes (128-byte aligned).

        Two buffers, each with a send area (the larger of ``M`` dispatch messages and ``E * M``
        combine messages), a receive area of ``E * M`` of the larger message and a signal
        area. ``ep`` sizes its own NVSHMEM buffers; callers pass this back to ``Buffer``.
        """
        max_tokens = _require_int(
            num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1
        )
        _require_int(hidden, "hidden", 1)
        _require_int(num_ranks, "num_ranks", 1)
        _require_int(num_experts, "num_experts", 1)
        scales = -(-hidden // 128)
        dispatch_msg = 16 + max(2 * hidden, hidden + 4 * scales)
        combine_msg = 4 * scales + 2 * hidden
        send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
        recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
        signal = -(-4 * num_experts // 128) * 128
        total = 2 * (send + recv + signal)
        return -(-total // 128) * 128

    # ----------------------------------------------------------------------------------------
    # Buffer state
    # ----------------------------------------------------------------------------------------

    def _set_up_masking(self) -> None:
        """Turns the group's auto-masking on for enable_shrink (off when a Buffer without it
        follows one that had it); refuses a Buffer that disagrees with an open one on the group.
        Creating a Buffer is collective, so every rank does the same here."""
        for other in _open_on(self.ep_group):
            if other.enable_shrink != self.enable_shrink:
                raise ValueError(
                    f"deep_ep (ep): a Buffer with enable_shrink={other.enable_shrink} is open on "
                    "these ranks; rank masking belongs to the ranks' shared ep group, so Buffers "
                    "on the same ranks must agree on enable_shrink (destroy the other first)"
                )
        if self.enable_shrink:
            ep_backend.low_latency_auto_mask(
                self._backend.options.kernel_timeout_s, group=self.ep_group
            )
            _facade_auto_mask.add(self.ep_group)
        elif self.ep_group in _facade_auto_mask:
            # left on by a shrink Buffer dropped without destroy()
            _masking_off(self.ep_group)
        _open_buffers.add(self)

    def _check_open(self) -> None:
        if self._destroyed:
            raise RuntimeError("deep_ep (ep): this Buffer was destroyed")

    def _require_low_latency(self, method: str) -> None:
        if not self.low_latency_mode:
            raise RuntimeError(
                f"deep_ep (ep): Buffer.{method} needs Buffer(..., low_latency_mode=True), as in "
                "DeepEP"
            )

    def _apply_config(
        self, config: Config | None, default: Callable[[int], Config], on_cuda: bool
    ) -> None:
        """Honours ``config.num_sms`` on the ep group (the other fields are hints ep sizes itself)."""
        if config is None:
            config = default(self.group_size)
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a deep_ep.Config, got {type(config).__name__}")
        options = self._backend.options
        if options.num_sms == config.num_sms:
            return
        if on_cuda and self._backend.high_throughput_transport != "undecided":
            raise ValueError(
                f"deep_ep (ep): config asks for {config.num_sms} SMs but this group's kernels were "
                f"built for {options.num_sms}; call Buffer.set_num_sms before the first dispatch"
            )
        options.num_sms = config.num_sms

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The CUDA stream on which this buffer's ``async_finish=True`` calls run."""
        self._check_open()
        return self._streams.get()

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """Not available: ep exposes no raw view of its peer-mapped buffers.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "deep_ep (ep): get_local_buffer_tensor is not available: ep's peer-mapped buffers "
            "belong to its kernels (use the dispatch outputs, or get_next_low_latency_combine_"
            "buffer for zero-copy combine)"
        )

    def destroy(self) -> None:
        """Releases the buffer (needs ``explicitly_destroy=True``); later calls raise.

        The shared ``"ep"`` group stays: other buffers on the same ranks use it. The last
        ``enable_shrink`` Buffer on it turns the group's auto-masking off (every rank calls
        ``destroy()``, as in DeepEP).
        """
        if not self.explicitly_destroy:
            raise RuntimeError(
                "deep_ep (ep): destroy() needs Buffer(..., explicitly_destroy=True), as in DeepEP"
            )
        self._check_open()
        self._destroyed = True
        self._last_layout = None
        _open_buffers.discard(self)
        if self.enable_shrink and not _open_on(self.ep_group):
            # the last shrink Buffer on the group: masking off
            if self.ep_group in _facade_auto_mask:
                _masking_off(self.ep_group)

    # ----------------------------------------------------------------------------------------
    # High-throughput (normal) mode
    # ----------------------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        **unsupported: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Per-rank and per-expert counts of a routing (local, no communication).

        Args:
            topk_idx: int64 (``topk_idx_t``) or int32 ``[T, K]`` global expert ids, -1 = none.
            num_experts: ``E``, a multiple of ``R``.
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream flags
                (``deep_ep.streams``).

        Returns:
            ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [num_nodes]
            for a group of several nodes (``ep_backend.topology``: hosts, or emulated ones),
            else int32 [R/8] for one host of more than 8 ranks, None within a node, num_tokens_per_expert int32 [E], is_token_in_rank bool
            [T, R], event)``.
        """
        self._check_open()
        _reject_keywords("get_dispatch_layout", unsupported)
        _require_tensor(topk_idx, "topk_idx", dim=2)
        _require_int(num_experts, "num_experts", 1)
        check_flags(previous_event, async_finish, allocate_on_comm_stream)
        # The first layout on CUDA may decide the group's transport: fix its SMs before.
        self._apply_config(None, Buffer.get_dispatch_config, topk_idx.is_cuda)
        layout, event = self._streams.run(
            lambda: ep_backend.get_dispatch_layout(topk_idx, num_experts, group=self.ep_group),
            topk_idx.device,
            previous_event,
            async_finish,
            (topk_idx,),
            lambda lay: (
                lay.num_tokens_per_rank,
                lay.num_tokens_per_expert,
                lay.is_token_in_rank,
                lay.send_pos,
            ),  # fmt: skip
        )
        self._last_layout = (layout, weakref.ref(topk_idx), _version(topk_idx))
        per_rdma_rank = None
        if self._num_nodes > 1:
            # The group's real (or emulated) nodes: tokens crossing the inter-node leg per node.
            per_rdma_rank = layout.num_tokens_per_node
        elif self.group_size > _NVL_PEERS_PER_NODE and self.group_size % _NVL_PEERS_PER_NODE == 0:
            # One host of more than 8 ranks: DeepEP's convention of nodes of 8.
            nodes = self.group_size // _NVL_PEERS_PER_NODE
            in_node = layout.is_token_in_rank.view(-1, nodes, _NVL_PEERS_PER_NODE).any(dim=2)
            per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
        return (
            layout.num_tokens_per_rank,
            per_rdma_rank,
            layout.num_tokens_per_expert,
            layout.is_token_in_rank,
            event,
        )

    def _layout_of(
        self, topk_idx: torch.Tensor, is_token_in_rank: torch.Tensor, num_experts: int
    ) -> ep_backend.DispatchLayout | None:
        """The ep layout of ``get_dispatch_layout(topk_idx)`` when the caller passes its results."""
        if self._last_layout is None:
            return None
        layout, ref, version = self._last_layout
        if (
            ref() is topk_idx
            and layout.is_token_in_rank is is_token_in_rank
            and _version(topk_idx) == version
            and layout.num_tokens_per_expert.numel() == num_experts
        ):
            return layout
        return None

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: IntranodeHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        **unsupported: Any,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, Any, EventOverlap]:
        """High-throughput dispatch: each token once to every rank its routing selects.

        Args:
            x: BF16 ``[T, H]`` (float16/32 also work on ep), or ``(x_fp8 [T, H] float8_e4m3fn,
                scales [T, H/128] float32 or int32 UE8M0, any strides)``; ``H * elem`` a
                multiple of 16 bytes.
            handle: a previous dispatch's handle: cached dispatch (same routing, new ``x``;
                ``topk_idx`` and ``topk_weights`` must be None; the layout arguments are not
                read, as in DeepEP).
            num_tokens_per_rank: int32 ``[R]`` from ``get_dispatch_layout`` (required).
            num_tokens_per_rdma_rank: from ``get_dispatch_layout``; not read (derived data).
            is_token_in_rank: bool ``[T, R]`` from ``get_dispatch_layout`` (required). Without
                ``topk_idx`` it alone routes the tokens.
            num_tokens_per_expert: int32 ``[E]`` (required with ``topk_idx``; gives ``E``).
            topk_idx: int64/int32 ``[T, K]`` global expert ids (-1 = none), or None.
            topk_weights: float32 ``[T, K]`` or None.
            expert_alignment: round each per-expert receive count up to a multiple of it.
            num_worst_tokens: > 0: outputs have exactly that many rows, no host sync.
            config: its ``num_sms`` is honoured (see ``Config``); default
                ``get_dispatch_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream flags.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
            handle, event)``. ``recv_x`` is ``[N, H]`` (or the tuple ``(recv_x_fp8,
            recv_scales [N, S])``), rows by source rank then source token; ``recv_topk_idx``
            holds local expert ids (-1 elsewhere, weight 0); both are None without
            ``topk_idx``, and the list is then empty (as with ``num_worst_tokens``).
            A cached dispatch returns ``(recv_x, None, None, None, None, event)``.
            ``handle`` indexes like DeepEP's intranode tuple (``handles.IntranodeHandle``).

        Raises:
            TypeError / ValueError: bad arguments (on this rank; ep's own checks, such as
                expert ids out of range, raise on every rank).
            NotImplementedError: dispatch without ``topk_idx`` on more than 32 ranks.
        """
        self._check_open()
        _reject_keywords("dispatch", unsupported)
        data, scales = _split_x(x)
        check_flags(previous_event, async_finish, allocate_on_comm_stream)
        _require_int(expert_alignment, "expert_alignment", 1)
        _require_int(num_worst_tokens, "num_worst_tokens")
        self._apply_config(config, Buffer.get_dispatch_config, data.is_cuda)
        fp8 = scales is not None
        if handle is not None:
            if not isinstance(handle, IntranodeHandle):
                raise TypeError(
                    f"handle must come from Buffer.dispatch, got {type(handle).__name__}"
                )
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=) takes no topk_idx or topk_weights")
            cached, event = self._streams.run(
                lambda: ep_backend.dispatch(
                    data, x_scales=scales, handle=handle.ep_handle, group=self.ep_group
                ),
                data.device,
                previous_event,
                async_finish,
                (data, scales),
                lambda out: (out.recv_x, out.recv_x_scales),
            )
            recv = (cached.recv_x, cached.recv_x_scales) if fp8 else cached.recv_x
            return recv, None, None, None, None, event

        if is_token_in_rank is None or num_tokens_per_rank is None:
            raise ValueError(
                "dispatch without handle needs num_tokens_per_rank and is_token_in_rank (from "
                "get_dispatch_layout)"
            )
        _require_tensor(is_token_in_rank, "is_token_in_rank", dim=2)
        _require_tensor(num_tokens_per_rank, "num_tokens_per_rank", dim=1)
        num_tokens = data.shape[0]
        if is_token_in_rank.dtype != torch.bool or tuple(is_token_in_rank.shape) != (
            num_tokens,
            self.group_size,
        ):
            raise ValueError(
                f"is_token_in_rank must be bool [T={num_tokens}, R={self.group_size}], got "
                f"{is_token_in_rank.dtype} {list(is_token_in_rank.shape)}"
            )
        if num_tokens_per_rank.numel() != self.group_size:
            raise ValueError(f"num_tokens_per_rank must have R={self.group_size} entries")
        layout = None
        if topk_idx is None:
            if topk_weights is not None:
                raise ValueError("topk_weights needs topk_idx")
            if self.group_size > _MAX_TOPK:
                raise NotImplementedError(
                    f"dispatch without topk_idx routes by one slot per rank; ep allows at most "
                    f"{_MAX_TOPK} slots, the group has {self.group_size} ranks"
                )
            # One pseudo-expert per rank: token t goes to rank r exactly when is_token_in_rank.
            ranks = torch.arange(self.group_size, device=is_token_in_rank.device)
            routing = torch.where(is_token_in_rank, ranks, -1)
            num_experts = self.group_size
        else:
            _require_tensor(topk_idx, "topk_idx", dim=2)
            if num_tokens_per_expert is None:
                raise ValueError(
                    "dispatch with topk_idx needs num_tokens_per_expert (from get_dispatch_layout)"
                )
            _require_tensor(num_tokens_per_expert, "num_tokens_per_expert", dim=1)
            routing = topk_idx
            num_experts = num_tokens_per_expert.numel()
            layout = self._layout_of(topk_idx, is_token_in_rank, num_experts)

        out, event = self._streams.run(
            lambda: ep_backend.dispatch(
                data,
                routing,
                topk_weights,
                num_experts,
                x_scales=scales,
                expert_alignment=expert_alignment,
                num_worst_tokens=num_worst_tokens,
                layout=layout,
                group=self.ep_group,
            ),  # fmt: skip
            data.device,
            previous_event,
            async_finish,
            (data, scales, routing, topk_weights),
            lambda o: (
                o.recv_x,
                o.recv_x_scales,
                o.recv_topk_idx,
                o.recv_topk_weights,
                o.num_recv_tokens_per_expert,
                o.handle.recv_src_idx,
                o.handle.recv_src_rank,
                o.handle.num_recv_tokens_per_rank,
            ),  # fmt: skip
        )
        recv = (out.recv_x, out.recv_x_scales) if fp8 else out.recv_x
        handle_out = IntranodeHandle(out.handle, self.rank)
        if topk_idx is None:
            return recv, None, None, [], handle_out, event
        return (
            recv,
            out.recv_topk_idx,
            out.recv_topk_weights,
            out.num_recv_tokens_per_expert_list,
            handle_out,
            event,
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: IntranodeHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        **unsupported: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """High-throughput combine: sum each dispatched row back into its source token.

        Args:
            x: BF16 (or float16/32) ``[N, H]`` in the layout of ``handle``'s dispatch.
            handle: that dispatch's handle.
            topk_weights: optional float32 ``[N, K]``, summed back the same way.
            bias: optional ``[T, H]`` tensor or pair of tensors added to the sum.
            config: its ``num_sms`` is honoured; default ``get_combine_config(R)``.
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream flags.

        Returns:
            ``(combined_x [T, H] of x's dtype, combined_topk_weights float32 [T, K] or None,
            event)``. Unweighted float32 sum over source ranks in ascending order, then the
            biases: bitwise deterministic.
        """
        self._check_open()
        _reject_keywords("combine", unsupported)
        _require_tensor(x, "x", dim=2)
        if not isinstance(handle, IntranodeHandle):
            raise TypeError(f"handle must come from Buffer.dispatch, got {type(handle).__name__}")
        check_flags(previous_event, async_finish, allocate_on_comm_stream)
        self._apply_config(config, Buffer.get_combine_config, x.is_cuda)
        biases = bias if isinstance(bias, tuple) else (bias,)
        out, event = self._streams.run(
            lambda: ep_backend.combine(
                x, handle.ep_handle, topk_weights, bias, group=self.ep_group
            ),
            x.device,
            previous_event,
            async_finish,
            (x, topk_weights, *biases),
            lambda o: (o.combined_x, o.combined_topk_weights),
        )
        return out.combined_x, out.combined_topk_weights, event

    # ----------------------------------------------------------------------------------------
    # Low-latency mode
    # ----------------------------------------------------------------------------------------

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Nothing to clean: ep's low-latency buffers are never shared with the normal kernels.

        DeepEP must zero its shared RDMA buffer after normal-mode calls dirtied it; ep keeps
        the two modes' memory apart, so the call only checks its arguments.
        """
        self._check_open()
        self._require_low_latency("clean_low_latency_buffer")
        _require_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1)
        _require_int(hidden, "hidden", 1)
        _require_int(num_experts, "num_experts", 1)

    def _require_shrink(self, method: str) -> None:
        self._check_open()
        if not self.enable_shrink:
            raise RuntimeError(f"deep_ep (ep): {method} needs Buffer(enable_shrink=True)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks a rank in this rank's low-latency calls.

        A masked rank is sent nothing and waited for by nobody; its experts' entries count as
        -1 (``ep_backend.low_latency_update_mask``). Local: every live rank masks it.

        Raises:
            RuntimeError: without ``enable_shrink=True``.
            TypeError / ValueError: ``rank_to_mask`` not a rank of the group, or this rank.
        """
        self._require_shrink("low_latency_update_mask_buffer")
        _require_bool(mask, "mask")
        if not isinstance(rank_to_mask, int) or isinstance(rank_to_mask, bool):
            raise TypeError(f"rank_to_mask must be an int, got {type(rank_to_mask).__name__}")
        ep_backend.low_latency_update_mask(rank_to_mask, mask, group=self.ep_group)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes the mask into ``mask_status`` (int32 ``[num_ranks]``, 1 = masked), in place.

        Masks set automatically (a peer that missed a call, see ``enable_shrink``) are included.
        """
        self._require_shrink("low_latency_query_mask_buffer")
        _require_tensor(mask_status, "mask_status", dim=1)
        if mask_status.dtype != torch.int32 or mask_status.numel() != self.group_size:
            raise ValueError(
                f"mask_status must be int32 [{self.group_size}], got {mask_status.dtype} "
                f"{list(mask_status.shape)}"
            )
        status = torch.zeros(self.group_size, dtype=torch.int32)
        status[ep_backend.low_latency_query_mask(self.ep_group)] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (local)."""
        self._require_shrink("low_latency_clean_mask_buffer")
        ep_backend.low_latency_clean_mask(self.ep_group)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        **unsupported: Any,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """Low-latency dispatch: one row per (token, selected expert), per-expert padded layout.

        Args:
            x: BF16 ``[T, H]``, ``T <= M``, ``H % 128 == 0`` (no hidden-size whitelist).
            topk_idx: int64/int32 ``[T, K]`` global expert ids (-1 = none).
            num_max_dispatch_tokens_per_rank: ``M``, the same on every rank.
            num_experts: ``E``, a multiple of ``R``.
            cumulative_local_expert_recv_stats: optional int32 ``[E_loc]``, incremented by the
                received counts (once received: after the hook with ``return_recv_hook``).
            dispatch_wait_recv_cost_stats: must be None (ep does not time receive waits).
            use_fp8: quantise on the sender to FP8 e4m3 with per-128-channel scales.
            round_scale: round the scales up to powers of two.
            use_ue8m0: pack the scales as UE8M0 (needs ``round_scale``, ``H % 512 == 0``).
            async_finish: return with an event to wait on (see ``deep_ep.streams``).
            return_recv_hook: send now; ``hook()`` receives (every rank once; at most two
                dispatches may await their hook). Excludes ``async_finish``.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` BF16 ``[E_loc, R*M, H]``
            or ``(float8_e4m3fn [E_loc, R*M, H], scales)``, scales float32 ``[E_loc, R*M,
            H/128]`` or int32 ``[E_loc, R*M, H/512]`` with ``use_ue8m0``, column-major in the
            last two dims as DeepEP's (a copy of ep's row-major scales); only the first
            ``recv_count[e]`` rows of expert ``e`` are valid. ``recv_count`` int32 ``[E_loc]``.
            ``handle`` is DeepEP's tuple ``(src_info, layout_range, M, H, E)``.
        """
        self._check_open()
        _reject_keywords("low_latency_dispatch", unsupported)
        self._require_low_latency("low_latency_dispatch")
        _require_tensor(x, "x", dim=2)
        _require_tensor(topk_idx, "topk_idx", dim=2)
        for name, value in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0),
                            ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):  # fmt: skip
            _require_bool(value, name)
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "deep_ep (ep): dispatch_wait_recv_cost_stats is not available: ep's kernels do "
                "not time their receive waits per source rank"
            )
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook exclude each other (as in DeepEP)")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0 needs round_scale=True (as in DeepEP)")
        stats = cumulative_local_expert_recv_stats

        def run() -> tuple[ep_backend.LowLatencyDispatchOutput, torch.Tensor | None]:
            out = ep_backend.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0,
                cumulative_local_expert_recv_stats=stats, return_recv_hook=return_recv_hook,
                group=self.ep_group,
            )  # fmt: skip
            scales = None
            if use_fp8:
                assert out.recv_x_scales is not None
                scales = _column_major(out.recv_x_scales)
                if scales is not out.recv_x_scales and not return_recv_hook:
                    scales.copy_(out.recv_x_scales)
            return out, scales

        (out, scales), event = self._streams.run(
            run,
            x.device,
            None,
            async_finish,
            (x, topk_idx, stats),
            lambda r: (
                r[0].recv_x,
                r[1],
                r[0].recv_count,
                r[0].handle.src_info,
                r[0].handle.layout_range,
            ),  # fmt: skip
        )
        hook = None
        if return_recv_hook:
            receive = out.hook
            ep_scales = out.recv_x_scales
            assert receive is not None

            def hook() -> None:
                """Receives this dispatch's rows (every rank, once)."""
                receive()
                if scales is not None and ep_scales is not None and scales is not ep_scales:
                    scales.copy_(ep_scales)

        recv = (out.recv_x, scales) if use_fp8 else out.recv_x
        return recv, out.recv_count, LowLatencyHandle(out.handle), event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """BF16 ``[E_loc, R*M, H]`` to write expert outputs into for a ``zero_copy`` combine.

        On ep's NVSHMEM path it is a view of the dispatch's send buffer (combine then skips its
        copy-in); elsewhere a tensor the facade keeps with the handle and combines from.
        """
        self._check_open()
        self._require_low_latency("get_next_low_latency_combine_buffer")
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(
                f"handle must come from low_latency_dispatch, got {type(handle).__name__}"
            )
        buffer = ep_backend.get_low_latency_combine_buffer(handle.ep_handle, group=self.ep_group)
        handle.combine_buffer = buffer
        return buffer

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
        **unsupported: Any,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Low-latency combine: ``out[t] = sum_k w[t, k] * y(t, expert_k)``, -1 skipped.

        Args:
            x: BF16 ``[E_loc, R*M, H]`` expert outputs in the dispatch's layout (not read with
                ``zero_copy``).
            topk_idx: the ``[T, K]`` ids given to that dispatch on this rank.
            topk_weights: float32 ``[T, K]``.
            handle: that dispatch's handle.
            use_logfmt: round the expert outputs through LogFMT-10 first (``deep_ep.logfmt``:
                the values of DeepEP's LogFMT combine; ep sends BF16).
            zero_copy: combine what was written into ``get_next_low_latency_combine_buffer``.
            async_finish: return with an event to wait on.
            return_recv_hook: DeepEP's split send/receive. ep's combine is complete when it
                returns, so the hook (which callers must still call) has nothing left to do.
            out: optional BF16 ``[T, H]`` output.
            combine_wait_recv_cost_stats: must be None (ep does not time receive waits).

        Returns:
            ``(combined_x BF16 [T, H], event, hook or None)``.
        """
        self._check_open()
        _reject_keywords("low_latency_combine", unsupported)
        self._require_low_latency("low_latency_combine")
        for name, value in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy),
                            ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):  # fmt: skip
            _require_bool(value, name)
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(
                f"handle must come from low_latency_dispatch, got {type(handle).__name__}"
            )
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError(
                "deep_ep (ep): combine_wait_recv_cost_stats is not available: ep's kernels do "
                "not time their receive waits per source rank"
            )
        if use_logfmt and zero_copy:
            raise ValueError("use_logfmt and zero_copy exclude each other (as in DeepEP)")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook exclude each other (as in DeepEP)")
        source = x
        if zero_copy:
            if handle.combine_buffer is None:
                raise ValueError(
                    "zero_copy=True needs the expert outputs written into "
                    "get_next_low_latency_combine_buffer(handle) first"
                )
            source = handle.combine_buffer
        _require_tensor(source, "x", dim=3)
        if use_logfmt:
            source = logfmt.encode_decode(source)
        combined, event = self._streams.run(
            lambda: ep_backend.low_latency_combine(
                source, topk_idx, topk_weights, handle.ep_handle, out=out, group=self.ep_group
            ),
            source.device,
            None,
            async_finish,
            (source, topk_idx, topk_weights),
            lambda r: (r,),
        )
        return combined, event, _no_op_hook if return_recv_hook else None
