"""How a session shows itself: widgets in a notebook kernel, progress bars or text elsewhere.

A view only subscribes to the session's events and registers where it shows itself
(Session.on_show); the session calls attach() for every session made with echo=True.
"""

from __future__ import annotations

import sys
from typing import Any

from .shell import importable, in_kernel


def attach(session: Any) -> Any:
    """Give `session` the view that fits where it runs; returns the view."""
    view: Any
    if in_kernel() and importable("ipywidgets"):
        from .widget import WidgetView

        view = WidgetView(session)
    else:
        from .terminal import TerminalView

        bars = importable("tqdm") and sys.stderr.isatty() and not in_kernel()
        view = TerminalView(session, bars=bars)
    session.view = view
    return view
