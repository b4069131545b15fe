"""Where this process runs: in a Jupyter kernel (widgets render), or not."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any


def ipython() -> Any:
    """The running IPython shell, or None (without importing IPython when nothing did)."""
    if "IPython" not in sys.modules:
        return None  # not imported: no shell runs here
    from IPython import get_ipython

    return get_ipython()


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (where widgets can render)."""
    shell = ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
