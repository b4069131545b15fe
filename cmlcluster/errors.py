"""Errors raised by cmlcluster.

Every error a user can hit names the bad value and says how to fix it.
"""

from __future__ import annotations


class CmlClusterError(Exception):
    """Base class of every error cmlcluster raises on purpose."""


class ConfigError(CmlClusterError, ValueError):
    """Bad input, refused before anything starts."""


class BackendError(CmlClusterError):
    """A backend could not do what it was asked (start, stop, find a worker)."""


class ControllerError(CmlClusterError):
    """The session's ipyparallel controller did not start or went away."""


class WorkerError(CmlClusterError):
    """Something run on a worker failed there; the message names the worker and quotes its traceback."""

    def __init__(self, message: str, worker_id: str | None = None):
        super().__init__(message)
        self.worker_id = worker_id


class SharedMachineWarning(UserWarning):
    """A server that runs code for whoever connects starts where other users of this machine reach it.

    Said once per session; ``warnings.simplefilter("ignore", SharedMachineWarning)`` silences it on a
    machine nobody else uses.
    """
