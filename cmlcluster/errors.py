"""Errors raised by cmlcluster.

Every error a user can hit names the bad value and says how to fix it. In a notebook (IPython's default
traceback mode) one of them shows as its message and a line saying `%tb` shows where it was raised: the
frames are cmlcluster's own, and 30-60 lines of them buried the sentence that says what to do. `%tb`,
any mode chosen with `%xmode`, and plain Python (scripts, pytest) show the whole traceback as ever.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

TB_HINT = "(cmlcluster's own error: %tb shows where it was raised)"


def install_hint(extra: str, packages: str) -> str:
    """How to get what one of cmlcluster's extras brings, true to how cmlcluster is installed: from its
    clone (it is not on PyPI), so the packages themselves, or the clone's install script."""
    return f"pip install {packages} into this Python (in cmlcluster's clone: bash scripts/install.sh {extra})"


def host_install_hint(python: str) -> str:
    """How to put this cmlcluster on another host (it is not on PyPI: a wheel built from its clone)."""
    return (
        "build a wheel in cmlcluster's clone (python -m pip wheel --no-deps -w dist .), copy it to the host "
        f"and install it there with {python} -m pip install <the wheel>"
    )


class CmlClusterError(Exception):
    """Base class of every error cmlcluster raises on purpose."""

    # IPython shows what `_render_traceback_()` returns instead of a traceback when the exception has one
    # (InteractiveShell.showtraceback asks hasattr). A property that raises AttributeError makes hasattr
    # false where the whole traceback is wanted, and IPython draws its own, in its own mode.
    @property
    def _render_traceback_(self) -> Callable[[], list[str]]:
        shell = _shell_wanting_short_form()
        if shell is None:
            raise AttributeError("_render_traceback_")
        # IPython's own line for the exception (its colours), without the frames; IPython joins with "\n".
        return lambda: ["".join(shell.InteractiveTB.get_exception_only(type(self), self)).rstrip("\n"), TB_HINT]


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


def _shell_wanting_short_form() -> Any:
    """The running IPython shell, if it shows cmlcluster's errors short: its traceback mode is the default
    one (the user chose no other with %xmode), and this is not `%tb` asking for the whole traceback."""
    module = sys.modules.get("IPython.core.interactiveshell")
    if module is None or not module.InteractiveShell.initialized():
        return None
    shell = module.InteractiveShell.instance()
    if getattr(shell.InteractiveTB, "mode", None) != "Context":
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "tb" and frame.f_globals.get("__name__") == "IPython.core.magics.execution":
            return None
        frame = frame.f_back
    return shell
