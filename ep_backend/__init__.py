"""ep_backend: the ``"ep"`` expert-parallel communication backend for torch.distributed.

``import ep_backend`` registers the backend name ``"ep"`` (devices cpu and cuda), so
``torch.distributed.init_process_group(backend="ep")`` returns a group that runs every standard
collective and the MoE collectives of this package (dispatch tokens to the ranks owning their
experts, combine expert outputs back).
"""

from __future__ import annotations

from ._native import native as _native
from ._registration import BACKEND_NAME, register

__version__ = "0.1.0"

_C = _native()
Options = _C.Options
EPProcessGroup = _C.EPProcessGroup

register()

from . import reference  # noqa: E402  (the executable spec, pure torch)
from .handles import (  # noqa: E402
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)
from .moe import (  # noqa: E402
    FallbackWarning,
    all_to_all_moe_dispatch,
    combine,
    dispatch,
    get_dispatch_layout,
    get_low_latency_combine_buffer,
    low_latency_combine,
    low_latency_dispatch,
    record_stream,
    reserve,
)


def get_backend(group=None) -> EPProcessGroup:
    """The ``EPProcessGroup`` behind ``group`` (default: the WORLD group).

    Raises:
        ValueError: if the group does not use the ``"ep"`` backend.
    """
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("ep: torch.distributed is not initialized")
    backend = pg._get_backend(torch.device("cpu"))
    wrapped = getattr(backend, "wrapped_pg", None)  # TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper
    if wrapped is not None:
        backend = wrapped
    if not isinstance(backend, EPProcessGroup):
        raise ValueError(f"ep: group uses backend {dist.get_backend(pg)!r}, not {BACKEND_NAME!r}")
    return backend


def _group_of(backend: EPProcessGroup):
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = backend.options.group_name
    if not name:
        raise RuntimeError("ep: this backend is not attached to a named process group")
    return _resolve_process_group(name)


def _bind_method(fn):
    def method(self, *args, **kwargs):
        if kwargs.get("group") is not None:
            raise TypeError("ep: the group of a backend method is the backend's own group")
        kwargs["group"] = _group_of(self)
        return fn(*args, **kwargs)

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


# The MoE collectives are also methods of the group's backend object (design card names).
for _fn in (all_to_all_moe_dispatch, combine, get_dispatch_layout, low_latency_dispatch,
            low_latency_combine, reserve):  # fmt: skip
    setattr(EPProcessGroup, _fn.__name__, _bind_method(_fn))


__all__ = [
    "BACKEND_NAME",
    "CombineOutput",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchOutput",
    "EPProcessGroup",
    "FallbackWarning",
    "LowLatencyDispatchOutput",
    "LowLatencyHandle",
    "Options",
    "__version__",
    "all_to_all_moe_dispatch",
    "combine",
    "dispatch",
    "get_backend",
    "get_dispatch_layout",
    "get_low_latency_combine_buffer",
    "low_latency_combine",
    "low_latency_dispatch",
    "record_stream",
    "reference",
    "register",
    "reserve",
]
