"""Making frameworks find the facade as ``deep_ep``: ``install()`` in-process, the shim folder
for spawned workers.

* ``install()`` puts this package in ``sys.modules`` as ``deep_ep`` and ``deep_ep.utils``. Call
  it before the framework is imported (Megatron binds ``HAVE_DEEP_EP`` at import time).
* Worker processes that vLLM and SGLang spawn start from a fresh interpreter and look for
  ``deep_ep`` with ``importlib.util.find_spec``. For them, put the shim folder on
  ``PYTHONPATH`` (children inherit it): ``export PYTHONPATH=$(python -m ep_backend.deep_ep
  --shim-path)${PYTHONPATH:+:$PYTHONPATH}``. The folder holds one package, ``deep_ep``, whose
  import runs ``install()``. Nothing is written into site-packages, and nothing happens unless
  that variable is set.

Neither shadows a real DeepEP: if one is importable, ``install()`` (and so the shim) raises,
unless forced (``install(force=True)``, or ``EP_DEEP_EP_FORCE=1`` for the shim).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["install", "shim_path", "uninstall"]

_NAME = "deep_ep"
_FACADE = __name__.rsplit(".", 1)[0]  # ep_backend.deep_ep


def shim_path() -> str:
    """The folder to put on ``PYTHONPATH`` so that spawned workers import the facade."""
    return os.path.realpath(Path(__file__).parent / "shim")


def _is_ours(module: ModuleType) -> bool:
    if module is sys.modules.get(_FACADE):
        return True
    origin = getattr(module, "__file__", None)
    return isinstance(origin, str) and os.path.realpath(origin).startswith(shim_path() + os.sep)


def _real_deep_ep_origin() -> str | None:
    """Where an importable DeepEP lives (the shim folder excluded), or None."""
    existing = sys.modules.get(_NAME)
    if existing is not None and not _is_ours(existing):
        return getattr(existing, "__file__", None) or repr(existing)
    shim = shim_path()
    search = [p for p in sys.path if os.path.realpath(p or os.curdir) != shim]
    spec = importlib.machinery.PathFinder.find_spec(_NAME, search)
    if spec is None:
        return None
    return spec.origin or str(list(spec.submodule_search_locations or []))


def install(force: bool = False) -> ModuleType:
    """Makes ``import deep_ep`` (and ``deep_ep.utils``) give ``ep_backend.deep_ep``.

    Idempotent. Returns the facade module.

    Args:
        force: install even where a real DeepEP is importable (it is then shadowed in this
            process).

    Raises:
        RuntimeError: a real DeepEP is importable (or imported) and ``force`` is False.
    """
    facade = sys.modules[_FACADE]
    if sys.modules.get(_NAME) is facade:
        return facade
    if not force:
        origin = _real_deep_ep_origin()
        if origin is not None:
            raise RuntimeError(
                f"deep_ep (ep): a real DeepEP is importable ({origin}); refusing to shadow it. "
                "Uninstall it, or call ep_backend.deep_ep.install(force=True) (EP_DEEP_EP_FORCE=1 "
                "for the PYTHONPATH shim) to use ep in its place."
            )
    sys.modules[_NAME] = facade
    sys.modules[_NAME + ".utils"] = facade.utils
    return facade


def uninstall() -> None:
    """Removes what ``install()`` put in ``sys.modules`` (modules imported from it keep it)."""
    for name in (_NAME, _NAME + ".utils"):
        module = sys.modules.get(name)
        if module is not None and (_is_ours(module) or module is sys.modules[_FACADE].utils):
            del sys.modules[name]
