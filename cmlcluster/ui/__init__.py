"""How a session shows itself: widgets in a notebook kernel, progress bars or text elsewhere.

The session knows nothing of this layer: importing cmlcluster registers attach() in
cmlcluster.session.viewers, and every session created with echo=True gets a view.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from .. import session as _session

if TYPE_CHECKING:
    from ..session import Session


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (where widgets can render)."""
    shell = _ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _ipython() -> Any:
    if "IPython" not in sys.modules:
        return None  # not imported: no shell runs here
    from IPython import get_ipython

    return get_ipython()


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def attach(session: Session) -> Any:
    """Give `session` the view that fits where it runs; returns the view."""
    view: Any
    if in_kernel() and _importable("ipywidgets"):
        from .widget import WidgetView

        view = WidgetView(session)
    else:
        from .terminal import TerminalView

        bars = _importable("tqdm") and sys.stderr.isatty() and not in_kernel()
        view = TerminalView(session, bars=bars)
    session.view = view
    return view


_session.viewers.append(attach)
