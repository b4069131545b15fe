"""`import cml.workers_v1` and `cml.utils_v1._emulate_cdsw()`, as CML's current runtimes have them,
where no real `cml` is installed.

CML's runtimes ship a package `cml` (cml.workers_v1: the worker API; cml.utils_v1._emulate_cdsw():
an object with cdsw's functions, for code written for the older `import cdsw`). cmlcluster does not
install a top-level `cml`: in a CML runtime it would overwrite CML's own. Instead `import cmlcluster`
(and so every worker's agent) appends a finder to the end of sys.meta_path that answers for `cml`
only when no finder before it found one: a real `cml` always wins, and this one is never seen there.

    cml/__init__.py    the package, with its two modules
    cml/workers_v1.py  launch_workers, await_workers, list_workers, stop_workers (cmlcluster.api)
    cml/utils_v1.py    _emulate_cdsw()
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the top-level `cml` in this folder; its modules are then found through its __path__."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "cml":
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [HERE])


def install() -> None:
    """Answer for `cml` where nothing else does (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
