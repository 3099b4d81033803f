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
        raise ValueError(
            f"ep: group uses backend {dist.get_backend(pg)!r}, not {BACKEND_NAME!r}"
        )
    return backend


__all__ = ["BACKEND_NAME", "EPProcessGroup", "Options", "get_backend", "register", "__version__"]
