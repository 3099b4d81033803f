"""ep_backend: the ``"ep"`` expert-parallel communication backend for torch.distributed.

``import ep_backend`` registers the backend name ``"ep"`` (devices cpu and cuda), so
``torch.distributed.init_process_group(backend="ep")`` returns a group that runs every standard
collective and the MoE collectives of this package (dispatch tokens to the ranks owning their
experts, combine expert outputs back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._native import native as _native
from ._registration import BACKEND_NAME, register

__version__ = "0.1.0"

_C = _native()
if TYPE_CHECKING:
    from ._C import EPProcessGroup, Options
else:
    Options = _C.Options
    EPProcessGroup = _C.EPProcessGroup

register()

# reference: the executable spec, pure torch. _fake: registers the ops' fake kernels, for
# torch.compile.
from . import _fake, reference  # noqa: E402, F401
from ._fallback import FallbackWarning  # noqa: E402
from ._groups import _bind_backend_methods, get_backend  # noqa: E402
from ._recovery import abort, monitored_barrier  # noqa: E402
from ._streams import record_stream  # noqa: E402
from ._topology import Topology, topology  # noqa: E402
from .all_to_all import all_to_all_check, all_to_all_v, all_to_all_v_2d  # noqa: E402
from .errors import MoEError, MoEInputError, MoETimeoutError, MoETypeError  # noqa: E402
from .handles import (  # noqa: E402
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)
from .low_latency import (  # noqa: E402
    get_low_latency_combine_buffer,
    low_latency_combine,
    low_latency_dispatch,
)
from .moe import (  # noqa: E402
    all_to_all_moe_dispatch,
    combine,
    dispatch,
    get_dispatch_layout,
    reserve,
)
from .rank_mask import (  # noqa: E402
    low_latency_auto_mask,
    low_latency_clean_mask,
    low_latency_query_mask,
    low_latency_update_mask,
)

# The MoE collectives are also methods of the group's backend object (design card names).
_bind_backend_methods(
    (all_to_all_moe_dispatch, combine, get_dispatch_layout, low_latency_dispatch,
     low_latency_combine, reserve)
)  # fmt: skip


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
    "MoEError",
    "MoEInputError",
    "MoETimeoutError",
    "MoETypeError",
    "Options",
    "Topology",
    "__version__",
    "abort",
    "all_to_all_check",
    "all_to_all_moe_dispatch",
    "all_to_all_v",
    "all_to_all_v_2d",
    "combine",
    "dispatch",
    "get_backend",
    "get_dispatch_layout",
    "get_low_latency_combine_buffer",
    "low_latency_combine",
    "low_latency_auto_mask",
    "low_latency_clean_mask",
    "low_latency_dispatch",
    "low_latency_query_mask",
    "low_latency_update_mask",
    "monitored_barrier",
    "record_stream",
    "reference",
    "register",
    "reserve",
    "topology",
]
