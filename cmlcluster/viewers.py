"""How a session is shown, without the session knowing its views: the UI (cmlcluster.ui) sits above the
session, and the package's face registers it when the package is imported. A session made with echo=True
is given a view (`attach`); a session that is a cell's value asks for its whole view (`display`).

ViewedSession is what a view may use of a session: the UI is typed against it, never against Session.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .events import CallStarted, Subscriber


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class ViewedSession(Protocol):
    """A session as its views see it (Session is one)."""

    id: str
    closed: bool

    @property
    def backend(self) -> _Named: ...

    def subscribe(self, callback: Subscriber, after_batch: Callable[[], None] | None = None) -> Callable[[], None]: ...

    def on_show(self, callback: Callable[[CallStarted], None]) -> None: ...

    def launched_by(self, worker: str | Mapping[str, Any]) -> str | None: ...

    def stop_workers(self, *ids: str | Mapping[str, Any]) -> list[Any]: ...

    def stop_workers_soon(self, *ids: str | Mapping[str, Any]) -> None: ...

    def xray_soon(self, done: Callable[[Any], None], *ids: str) -> None: ...

    def worker_log_path(self, worker: str | Mapping[str, Any]) -> str: ...


_attach: Callable[[ViewedSession], None] | None = None
_display: Callable[[ViewedSession], bool] | None = None


def register(attach: Callable[[ViewedSession], None], display: Callable[[ViewedSession], bool]) -> None:
    """The viewer: `attach(session)` gives a session its view; `display(session)` shows its whole view as a
    cell's value and says whether there was one to show."""
    global _attach, _display
    _attach, _display = attach, display


def attach(session: ViewedSession) -> None:
    if _attach is not None:
        _attach(session)


def display(session: ViewedSession) -> bool:
    return _display is not None and _display(session)
