"""The sessions open in this process: the newest is where report() sends progress, and
any still open when the interpreter exits are closed then."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import weakref
from typing import Any

_open: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_order = itertools.count()


def add(session: Any) -> None:
    _open[next(_order)] = session


def discard(session: Any) -> None:
    for key, value in list(_open.items()):
        if value is session:
            del _open[key]


def sessions() -> list[Any]:
    """The open sessions, oldest first."""
    return [s for _, s in sorted(_open.items(), key=lambda kv: kv[0]) if not s.closed]


def newest() -> Any:
    found = sessions()
    return found[-1] if found else None


@atexit.register
def _close_all() -> None:
    for session in sessions():
        with contextlib.suppress(Exception):
            session.close()
