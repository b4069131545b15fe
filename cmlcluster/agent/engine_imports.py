"""What a worker's engine leaves unimported as it starts, though ipyparallel would import it.

An agent's start is the floor of every launch: its CPU is what a cluster's workers share as they
start on a host's cores, and what a Horovod or TensorFlow worker waits for before its real work.
Two things ipyparallel imports there that an engine never uses, measured on this machine:

- the package's __init__ (the client and the cluster launcher): 20 to 40 ms of CPU;
- numpy, which the serializer imports at the engine's first reply to resolve the "numpy.ndarray"
  of its can_map: about 0.2 s of CPU (with OpenBLAS's threads), in every worker, whose program
  may never touch numpy.

Both stay importable: user code's `ipyparallel.Client` runs the package's __init__ at that use,
and a numpy array is serialized as ipyparallel serializes it once anything imported numpy (an
array cannot exist before). Each is skipped, leaving ipyparallel as it is, where what it relies
on is not found.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _collections_abc import dict_items

# Names of the package that an engine itself asks for, and the submodule that defines each: the can_map
# names "ipyparallel.dependent" (ipyparallel/serialize/canning.py), resolved at the engine's first reply.
ENGINE_NAMES = {"dependent": "controller.dependency"}


def engine_without_the_client(package: str = "ipyparallel") -> None:
    """`import ipyparallel.engine...` without the package's __init__. Its other names run the __init__ at
    their first use; its submodules, and ENGINE_NAMES, import as usual. Nothing changes where the package is
    imported already."""
    spec = importlib.util.find_spec(package)
    if package in sys.modules or spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    loader = spec.loader
    module = importlib.util.module_from_spec(spec)
    lock = threading.Lock()

    def first_use(name: str) -> Any:
        where = f"{package}.{ENGINE_NAMES.get(name, name)}"
        if importlib.util.find_spec(where) is not None:  # a submodule (`from ipyparallel import util`), or its name
            found = importlib.import_module(where)
            if name not in ENGINE_NAMES:
                return found
            if hasattr(found, name):
                return getattr(found, name)
        with lock:
            if module.__dict__.pop("__getattr__", None) is not None:
                loader.exec_module(module)  # the __init__, in the module every submodule already hangs on
        return getattr(module, name)

    module.__dict__["__getattr__"] = first_use  # PEP 562
    sys.modules[package] = module


class TypesOfImportedModules(dict[Any, Any]):
    """A can_map whose types named by a string ("numpy.ndarray") stay out of it until their module has been
    imported by something else. ipyparallel's can() reads the map through items(), and resolves the names it
    finds there (importing their modules): a name goes back in at the first items() after its module is
    imported, and ipyparallel resolves it then, as it would have at the first reply."""

    def __init__(self, mapping: Mapping[Any, Any]):
        super().__init__((k, v) for k, v in mapping.items() if not self._waits(k))
        self.waiting = {k: v for k, v in mapping.items() if self._waits(k)}

    @staticmethod
    def _waits(key: Any) -> bool:
        return isinstance(key, str) and key.partition(".")[0] not in sys.modules

    def items(self) -> dict_items[Any, Any]:
        for key in [k for k in self.waiting if not self._waits(k)]:
            self[key] = self.waiting.pop(key)
        return super().items()


def replies_import_only_what_is_imported() -> None:
    """ipyparallel's can_map (in canning, and as ipyparallel.serialize re-exports it) as TypesOfImportedModules."""
    from ipyparallel import serialize
    from ipyparallel.serialize import canning

    if type(canning.can_map) is not dict or serialize.can_map is not canning.can_map:
        return  # made already, or not the map this knows
    if "can_map.items()" not in inspect.getsource(canning.can):
        return  # a can() that reads the map some other way
    canning.can_map = serialize.can_map = TypesOfImportedModules(canning.can_map)
