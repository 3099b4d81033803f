"""Loads the native module ``ep_backend._C`` with an error that says how to build it."""

from __future__ import annotations

import importlib
from types import ModuleType

_native: ModuleType | None = None
_import_error: BaseException | None = None


def native() -> ModuleType:
    """The native module; raises ImportError with build instructions if it is missing."""
    global _native, _import_error
    if _native is not None:
        return _native
    try:
        import torch  # noqa: F401  (loads libtorch before our extension)
        import torch.distributed  # noqa: F401

        _native = importlib.import_module("ep_backend._C")
    except ImportError as exc:  # pragma: no cover - exercised only on broken installs
        _import_error = exc
        raise ImportError(
            "ep_backend's native module is not built or was built against another torch. "
            "Rebuild it against the installed torch with "
            "`pip install --no-build-isolation .` in the ep source tree "
            f"(original error: {exc})"
        ) from exc
    return _native
