"""Which view each session of this process has: the UI's own record (the session knows no view)."""

from __future__ import annotations

import weakref
from typing import Any, TypeVar

from ..viewers import ViewedSession

View = TypeVar("View")

_views: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def remember(session: ViewedSession, view: View) -> View:
    _views[session] = view
    return view


def view_of(session: ViewedSession) -> Any:
    """The session's view (a SessionViews, a TerminalView), or None."""
    return _views.get(session)
