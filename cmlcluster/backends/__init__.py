"""Where workers run: the Backend contract (base.py), the registry of backends by name (registry.py), and
the backends themselves, each a module of its own.

Its names are imported when first used: the worker's side of a backend (an SSH host's relay and
results_host, a pod agent's agent_results) imports its module of this package, which would otherwise
import the session's side first (the registry's entry points, asyncio: 43 ms of each SSH worker's start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

_EXPORTS = {
    "base": ("Backend", "Capabilities", "SessionContext"),
    "registry": (
        "ENTRY_POINT_GROUP",
        "add_backend_arguments",
        "backend_class",
        "backend_from",
        "backends_help",
        "known_backends",
        "make_backend",
        "options_of",
        "resolve_backend",
    ),
}

if TYPE_CHECKING:
    from .base import Backend, Capabilities, SessionContext
    from .registry import (
        ENTRY_POINT_GROUP,
        add_backend_arguments,
        backend_class,
        backend_from,
        backends_help,
        known_backends,
        make_backend,
        options_of,
        resolve_backend,
    )


__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals())


__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "Capabilities",
    "SessionContext",
    "add_backend_arguments",
    "backend_class",
    "backend_from",
    "backends_help",
    "known_backends",
    "make_backend",
    "options_of",
    "resolve_backend",
]
