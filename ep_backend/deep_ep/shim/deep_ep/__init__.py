"""Opt-in shim: with this package's parent folder on ``PYTHONPATH``, ``import deep_ep`` (in any
process that inherits the variable) gives ``ep_backend.deep_ep``.

Set ``PYTHONPATH=$(python -m ep_backend.deep_ep --shim-path)``. Importing it fails if a real
DeepEP is importable too, unless ``EP_DEEP_EP_FORCE=1``.
"""

import os
import sys

from ep_backend.deep_ep import install

sys.modules[__name__] = install(force=os.environ.get("EP_DEEP_EP_FORCE") == "1")
