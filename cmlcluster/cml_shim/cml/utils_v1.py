"""`cml.utils_v1._emulate_cdsw()`: an object with cdsw's worker functions, as CML's runtimes give it."""

from types import ModuleType


def _emulate_cdsw() -> ModuleType:
    """What `import cdsw` gave: launch_workers, await_workers, list_workers, stop_workers (cmlcluster.api)."""
    from cmlcluster import api

    return api
