"""matplotlib's pyplot for the bench's plots, off-screen, or None where the optional ``bench``
extra is not installed (the plots are then skipped)."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
