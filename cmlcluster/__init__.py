"""cmlcluster: Cloudera ML's worker API, and distributed training, from any notebook.

import cmlcluster as cdsw
workers = cdsw.launch_workers(n=2, cpu=1, memory=1, code="print('hello')")
cdsw.await_workers(workers)
"""

from . import ui as _ui  # noqa: F401  (registers the views every session shows itself with)
from .api import (
    await_workers,
    client,
    get_session,
    launch_workers,
    list_workers,
    stop_session,
    stop_workers,
    tensorboard,
    use_backend,
)
from .errors import BackendError, CmlClusterError, ConfigError, ControllerError, WorkerError
from .events import Event
from .horovod import HorovodError, HorovodResult, run_horovod
from .progress import keras_callback, report
from .pytorch import TorchError, TorchResult, run_torch
from .session import Session
from .tensorflow import TFCluster, run_cluster, start_cluster
from .workers import Program

__version__ = "0.1.0"


def load_ipython_extension(ipython: object) -> None:
    """%load_ext cmlcluster: the %horovod, %%horovod, %torchrun and %%torchrun magics."""
    from .magics import load_ipython_extension as load

    load(ipython)


__all__ = [
    "BackendError",
    "CmlClusterError",
    "ConfigError",
    "ControllerError",
    "Event",
    "HorovodError",
    "HorovodResult",
    "Program",
    "Session",
    "TFCluster",
    "TorchError",
    "TorchResult",
    "WorkerError",
    "await_workers",
    "client",
    "get_session",
    "keras_callback",
    "launch_workers",
    "list_workers",
    "load_ipython_extension",
    "report",
    "run_cluster",
    "run_horovod",
    "run_torch",
    "start_cluster",
    "stop_session",
    "stop_workers",
    "tensorboard",
    "use_backend",
]
