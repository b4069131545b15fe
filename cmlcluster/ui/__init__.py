"""How a session shows itself: widgets in a notebook kernel, progress bars or text elsewhere.

A view only subscribes to the session's events and registers where it shows itself
(Session.on_show: at the start of each call that starts or waits for work); the session calls
attach() for every session made with echo=True. Both kinds draw the same model (model.py).
"""

from __future__ import annotations

import sys
from typing import Any

from .shell import importable, in_kernel


def attach(session: Any) -> Any:
    """Give `session` the view that fits where it runs; returns the view."""
    view: Any
    if in_kernel() and importable("ipywidgets"):
        from .widget import SessionViews

        view = SessionViews(session)  # a view per call, shown in the cell that makes it
    else:
        from .terminal import TerminalView

        bars = importable("tqdm") and sys.stderr.isatty() and not in_kernel()
        view = TerminalView(session, bars=bars)
    session.view = view
    return view
