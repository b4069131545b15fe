"""Checking, before use, that a library still has the private names cmlcluster reads of it
(tensorflow/internals.py, control/ipyparallel_internals.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Check = tuple[str, Callable[[], bool]]  # (what it reads, in words; whether it is there)


def missing(checks: Sequence[Check]) -> list[str]:
    """The description of each check that fails; a check that raises (an import, an attribute
    that is not there) fails."""
    found = []
    for what, present in checks:
        try:
            ok = bool(present())
        except Exception:
            ok = False
        if not ok:
            found.append(what)
    return found
