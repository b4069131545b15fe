"""CML's worker API as module functions, on one default session per process.

``import cmlcluster as cdsw`` then works like CML's ``import cdsw``. The default
session starts on first use on the backend named by CMLCLUSTER_BACKEND (default
"local"); ``use_backend`` chooses another before the first launch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .backends import Backend, resolve_backend
from .errors import ConfigError
from .session import Session, check_silence_timeout
from .workers import StopResponse

_default: Session | None = None
_default_lock = threading.Lock()
_backend: str | Backend | None = None
_backend_options: dict[str, Any] = {}


def use_backend(backend: str | Backend | None, *, silence_timeout: float | None = None, **options: Any) -> None:
    """Choose the default session's backend (and its options); only before it has workers.

    ``None`` goes back to the backend CMLCLUSTER_BACKEND names (default "local"). An unknown
    name, or an option the backend does not take, is refused here, before anything starts.
    silence_timeout is the session's (see Session): how long a silent worker counts as alive.
    """
    global _backend, _backend_options
    check_silence_timeout(silence_timeout)
    # use_backend(None) alone only forgets a choice; CMLCLUSTER_BACKEND is checked when it is used.
    if backend is not None or options:
        resolve_backend(_named(backend), options)
    if _default is not None and not _default.closed and _default.list_workers():
        raise ConfigError(
            f"use_backend({backend!r}) after workers were launched on {_default.backend.name!r}; "
            "call stop_session() first"
        )
    stop_session()
    _backend, _backend_options = backend, options
    if silence_timeout is not None:
        _backend_options["silence_timeout"] = silence_timeout  # the Session's own option, beside the backend's


def _named(backend: str | Backend | None) -> str | Backend:
    """The backend chosen: the one given, else the one CMLCLUSTER_BACKEND names (default "local")."""
    return backend if backend is not None else os.environ.get("CMLCLUSTER_BACKEND", "local")


def get_session() -> Session:
    """The default session, started on first use."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Session(_named(_backend), **_backend_options)
        return _default


def stop_session() -> None:
    """Stop the default session's workers and controller."""
    global _default
    with _default_lock:
        session, _default = _default, None
    if session is not None:
        session.close()


def launch_workers(
    n: int,
    cpu: float,
    memory: float,
    nvidia_gpu: int = 0,
    kernel: str = "python3",
    script: str = "",
    code: str = "",
    env: Mapping[str, str] | None = None,
    name: str = "",
    *,
    collect: str | Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """Launch n workers, each with `cpu` cores, `memory` GB and `nvidia_gpu` GPUs.

    Each runs `script` (a path) or `code` (an IPython cell: indented source, `!cmd` and
    `%magic` lines), or with neither serves the control plane until stopped. name: the workers'
    name, in their dicts, as CML's newer workspaces take it. collect (not in
    CML, where every worker writes to the project's disk): paths under the worker's working folder
    ("outputs", "model.keras") that come to this working folder when it ends (Session.launch_workers).
    """
    return get_session().launch_workers(n, cpu, memory, nvidia_gpu, kernel, script, code, env, name, collect=collect)


def await_workers(
    ids: Iterable[str | Mapping[str, Any]],
    wait_for_completion: bool = True,
    timeout_seconds: float = 60,
) -> dict[str, list[dict[str, Any]]]:
    """Wait for workers to finish (or, with wait_for_completion=False, to run); 0 waits without a limit."""
    return get_session().await_workers(ids, wait_for_completion, timeout_seconds)


def list_workers() -> list[dict[str, Any]]:
    """Every worker of the default session, finished ones included."""
    return get_session().list_workers() if _default is not None else []


def stop_workers(*ids: str | Mapping[str, Any]) -> list[StopResponse]:
    """Stop these workers, or all of the default session's workers when none are named.

    One response per worker, as CML's: the worker's dict, with `status_code` and `ok` (Session.stop_workers).
    """
    return get_session().stop_workers(*ids) if _default is not None else []


def tensorboard(logdir: str, port: int | None = None) -> Any:
    """TensorBoard on `logdir` for the default session (like cdsw_tensorflow_utils.tensorboard)."""
    return get_session().tensorboard(logdir, port)


def client() -> Any:
    """The ipyparallel Client of the default session's workers (for %px and views)."""
    return get_session().client
