"""`import cml.workers_v1` and `cml.utils_v1._emulate_cdsw()`, as CML's current runtimes have them,
where no real `cml` is installed.

CML's runtimes ship a package `cml` (cml.workers_v1: the worker API; cml.utils_v1._emulate_cdsw():
an object with cdsw's functions, for code written for the older `import cdsw`). cmlcluster does not
install a top-level `cml`: in a CML runtime it would overwrite CML's own. Instead a finder at the end
of sys.meta_path answers for `cml` only when no finder before it found one: a real `cml` always wins,
and this one is never asked there. Two things put it there:

- at interpreter start, the installed `cmlcluster-cml.pth` (setup.py writes it and copies startup.py
  beside it as the top-level module `_cmlcluster_cml`): `import cml` works in a fresh Python that
  never imported cmlcluster, as on CML's runtimes;
- `import cmlcluster` (and so every worker's agent), for a cmlcluster that runs from its folder
  uninstalled (an SSH host's shipped copy, PYTHONPATH).

Either one is enough; install() adds none beside the other (both carry CML_FINDER).

    cml/__init__.py    the package, with its two modules
    cml/workers_v1.py  launch_workers, await_workers, list_workers, stop_workers (cmlcluster.api)
    cml/utils_v1.py    _emulate_cdsw()
    startup.py         the finder the .pth installs: asks find_spec here only when `cml` is imported
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))
CML_FINDER = "cmlcluster_cml_finder"  # an attribute that marks either finder (startup.py has the same name)


def find_spec(
    fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None, *, finder: object = None
) -> importlib.machinery.ModuleSpec | None:
    """The spec of the top-level `cml` in this folder (its modules are then found through its __path__),
    unless a finder after `finder` in sys.meta_path (one a later .pth appended: a real CML's editable
    install) finds another: a real `cml` wins wherever its finder stands."""
    if fullname != "cml":
        return None
    after = sys.meta_path[sys.meta_path.index(finder) + 1 :] if finder in sys.meta_path else []
    for other in after:
        spec = getattr(other, "find_spec", None) and other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return importlib.machinery.PathFinder.find_spec(fullname, [HERE])


class _Finder:
    """A meta path finder (importlib.abc is not imported for it: 10 ms of every worker's start)."""

    cmlcluster_cml_finder = True

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return find_spec(fullname, path, target, finder=self)


def install() -> None:
    """Answer for `cml` where nothing else does (idempotent, and none beside startup.py's)."""
    if not any(getattr(f, CML_FINDER, False) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
