"""Errors raised by cmlcluster.

Every error a user can hit names the bad value and says how to fix it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


class CmlClusterError(Exception):
    """Base class of every error cmlcluster raises on purpose."""


class ConfigError(CmlClusterError, ValueError):
    """Bad input, refused before anything starts."""


class BackendError(CmlClusterError):
    """A backend could not do what it was asked (start, stop, find a worker)."""


class ControllerError(CmlClusterError):
    """The session's ipyparallel controller did not start or went away."""


class CommandError(CmlClusterError):
    """A command exited non-zero. Carries the argv, exit code and output."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str = "", stderr: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        detail = (stderr or stdout).strip()
        message = f"command {shlex.join(self.argv)!r} exited with code {returncode}"
        super().__init__(f"{message}: {detail[-2000:]}" if detail else message)
