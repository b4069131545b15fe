"""cmlcluster: Cloudera ML's worker API, and distributed training, from any notebook.

import cmlcluster as cdsw
workers = cdsw.launch_workers(n=2, cpu=1, memory=1, code="print('hello')")
cdsw.await_workers(workers)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy, cml_shim, viewers
from ._version import __version__ as __version__

cml_shim.install()  # `import cml.workers_v1` where no real CML is installed (cml_shim says why this way)


def _attach_view(session: viewers.ViewedSession) -> None:
    from .ui import attach

    attach(session)


def _display_view(session: viewers.ViewedSession) -> bool:
    from .ui import display

    return display(session)


# The views sit above the session, which never imports them: they are registered here, and imported at a
# session's first need of one.
viewers.register(_attach_view, _display_view)

# Imported when first used, not with the package: every worker's agent runs as
# `python -m cmlcluster.agent`, which imports this package first and needs none of the
# session's side (0.13 s of CPU in each worker's start).
_EXPORTS = {
    "api": (
        "await_workers",
        "client",
        "get_session",
        "launch_workers",
        "list_workers",
        "stop_session",
        "stop_workers",
        "tensorboard",
        "use_backend",
        "xray",
    ),
    "blocking": ("StoppedFromWidget",),
    "errors": (
        "BackendError",
        "CmlClusterError",
        "ConfigError",
        "ControllerError",
        "SharedMachineWarning",
        "WorkerError",
    ),
    "events": ("Event",),
    "accelerate": ("AccelerateError", "AccelerateResult", "run_accelerate"),
    "horovod": ("HorovodError", "HorovodResult", "run_horovod"),
    "jax": ("JaxError", "JaxResult", "run_jax"),
    "progress": ("keras_callback", "report"),
    "pytorch": ("TorchError", "TorchResult", "run_torch"),
    "session": ("Session",),
    "tensorflow": ("TFCluster", "run_cluster", "start_cluster"),
    "workers": ("Program",),
}

if TYPE_CHECKING:
    from .accelerate import AccelerateError, AccelerateResult, run_accelerate
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
        xray,
    )
    from .blocking import StoppedFromWidget
    from .errors import BackendError, CmlClusterError, ConfigError, ControllerError, SharedMachineWarning, WorkerError
    from .events import Event
    from .horovod import HorovodError, HorovodResult, run_horovod
    from .jax import JaxError, JaxResult, run_jax
    from .progress import keras_callback, report
    from .pytorch import TorchError, TorchResult, run_torch
    from .session import Session
    from .tensorflow import TFCluster, run_cluster, start_cluster
    from .workers import Program


__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals())


def load_ipython_extension(ipython: object) -> None:
    """%load_ext cmlcluster: the %horovod, %torchrun, %jaxrun and %accelerate magics (and their %% forms)."""
    from .magics import load_ipython_extension as load

    load(ipython)


__all__ = [
    "AccelerateError",
    "AccelerateResult",
    "BackendError",
    "CmlClusterError",
    "ConfigError",
    "ControllerError",
    "Event",
    "HorovodError",
    "HorovodResult",
    "JaxError",
    "JaxResult",
    "Program",
    "Session",
    "SharedMachineWarning",
    "StoppedFromWidget",
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
    "run_accelerate",
    "run_cluster",
    "run_horovod",
    "run_jax",
    "run_torch",
    "start_cluster",
    "stop_session",
    "stop_workers",
    "tensorboard",
    "use_backend",
    "xray",
]
