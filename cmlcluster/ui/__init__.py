"""How a session shows itself: widgets in a notebook kernel, progress bars or text elsewhere.

The UI sits above the session: the package's face registers `attach` and `display` with
cmlcluster.viewers, and the session, which imports none of this, calls them. A view only subscribes
to the session's events and registers where it shows itself (on_show: at the start of each call that
starts or waits for work). Both kinds draw the same model.

- ``model``: the views' model: a reducer over the session's events, and the router to a view per call
- ``widget``: the notebook's views (ipywidgets, bqplot): a view per call and the whole session's
- ``terminal``: the same story as progress bars (tqdm) or text
- ``shell``: where this runs (a kernel, a terminal) and what is importable there
- ``attached``: which view each session of this process has
- ``kernel_internals``: the private names of ipykernel the widgets' Stop relies on
"""

from __future__ import annotations

import sys
from typing import Any

from ..viewers import ViewedSession
from .attached import remember, view_of
from .shell import importable, in_kernel


def attach(session: ViewedSession) -> Any:
    """Give `session` the view that fits where it runs; returns the view."""
    view: Any
    if in_kernel() and importable("ipywidgets"):
        from .widget import SessionViews

        view = SessionViews.of(session)  # a view per call, shown in the cell that makes it
    else:
        from .terminal import TerminalView

        bars = importable("tqdm") and sys.stderr.isatty() and not in_kernel()
        view = remember(session, TerminalView(session, bars=bars))
    return view


def display(session: ViewedSession) -> bool:
    """Show the whole session's view as a cell's value; False where it has none (echo=False, a terminal)."""
    whole = getattr(view_of(session), "whole", None)
    if whole is None:
        return False
    whole().display()
    return True
