# Types of the native module's classes as Python sees them (python_api/bindings.cpp), for type
# checkers and editors; the module itself is compiled. Module-level entry points are reached
# through ep_backend._native.native() and are not listed here.
import datetime
import enum
from collections.abc import Callable

import torch
from torch._C._distributed_c10d import Backend, Store

class Options(Backend.Options):
    num_sms: int
    kernel_timeout_s: float
    overlap_dispatch_host_wait: bool
    low_latency_combine_bf16_partials: bool
    recv_slabs: int
    ranks_per_node: int
    timeout: datetime.timedelta
    def __init__(
        self,
        timeout: datetime.timedelta = ...,
        num_sms: int = 24,
        kernel_timeout_s: float = 60.0,
        overlap_dispatch_host_wait: bool = True,
        recv_slabs: int = 2,
        ranks_per_node: int = 0,
        low_latency_combine_bf16_partials: bool = False,
    ) -> None: ...
    def __copy__(self) -> Options: ...
    def __deepcopy__(self, memo: dict) -> Options: ...

class TransportKind(enum.Enum):
    undecided = 0
    nvlink = 1
    nvshmem = 2
    aten = 3
    internode = 4

class TransportChoice:
    @property
    def kind(self) -> TransportKind: ...
    @property
    def reason(self) -> str: ...
    @property
    def requested(self) -> bool: ...

class EPProcessGroup(Backend):
    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        options: Options,
        cpu_backend: Backend,
        cuda_backend: Backend | None = None,
    ) -> None: ...
    @property
    def options(self) -> Options: ...
    @property
    def store(self) -> Store: ...
    @property
    def has_cuda_backend(self) -> bool: ...
    @property
    def is_shutdown(self) -> bool: ...
    @property
    def moe_agreement_transport(self) -> str: ...
    @property
    def high_throughput_transport(self) -> str: ...
    @property
    def low_latency_transport(self) -> str: ...
    @property
    def all_to_all_transport(self) -> str: ...
    @property
    def high_throughput_transport_choice(self) -> TransportChoice: ...
    @property
    def low_latency_transport_choice(self) -> TransportChoice: ...
    @property
    def all_to_all_transport_choice(self) -> TransportChoice: ...
    @property
    def moe_unusable_reason(self) -> str: ...
    def inner_backend(self, device_type: str) -> Backend: ...
    def _set_topology(
        self,
        num_nodes: int,
        ranks_per_node: int,
        node_of_rank: list[int],
        local_rank: list[int],
        emulated: bool,
        problem: str,
    ) -> None: ...
    def _topology(self) -> tuple[int, int, list[int], list[int], bool, str]: ...
    def _use_store_row_gather(self) -> None: ...
    def _all_to_all_v(
        self,
        input: torch.Tensor,
        splits: torch.Tensor,
        output: torch.Tensor,
        num_local_experts: int,
        flat: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...
    def _take_all_to_all_error(self) -> str: ...
    def _low_latency_receive(self, layout_range: torch.Tensor) -> None: ...
    def _low_latency_combine_buffer(
        self,
        layout_range: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        hidden: int,
    ) -> torch.Tensor: ...
    def _low_latency_update_mask(self, rank: int, masked: bool) -> None: ...
    def _low_latency_mask(self) -> list[int]: ...
    def _low_latency_clean_mask(self) -> None: ...
    def _low_latency_auto_mask(self, timeout_s: float | None) -> None: ...
    def _low_latency_mask_tensor(self, device: torch.device) -> torch.Tensor: ...
    def _reserve(
        self,
        device_index: int,
        num_tokens: int,
        hidden_bytes: int,
        topk: int,
        num_scales: int,
        num_experts: int,
    ) -> list[int] | None: ...
    def _shift_moe_calls(self, delta: int) -> None: ...
    def _register_group_name(self, group_name: str) -> None: ...
    def _set_split_factory(self, factory: Callable[..., object]) -> None: ...
