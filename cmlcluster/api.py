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
from .session import Session, check_idle_timeout_and_ttl, check_silence_timeout, check_stragglers
from .stacks import XRay
from .stragglers import STRAGGLER_FRACTION, STRAGGLER_WINDOW
from .workers import StopResponse

_default: Session | None = None
_default_lock = threading.Lock()
_backend: str | Backend | None = None
_backend_options: dict[str, Any] = {}


def use_backend(
    backend: str | Backend | None,
    *,
    silence_timeout: float | None = None,
    idle_timeout: float | None = None,
    ttl: float | None = None,
    straggler_fraction: float | None = STRAGGLER_FRACTION,
    straggler_window: float = STRAGGLER_WINDOW,
    **options: Any,
) -> None:
    """Choose the default session's backend (and its options); only before it has workers.

    An unknown name, or an option the backend does not take, is refused here, before anything
    starts. The default session, if one is open (without workers), is stopped; the next call that
    needs one starts it on this backend.

    Parameters
    ----------
    backend : str | Backend | None
        A backend's name ("local", "docker", "ssh", "kubernetes", or one registered) or a Backend
        instance. ``None`` goes back to the backend CMLCLUSTER_BACKEND names (default "local"); given
        alone, it only forgets the choice, and that name is checked when the session starts.
    silence_timeout : float | None, default None
        The session's (see Session): how long, in seconds, a silent worker counts as alive before it
        counts as lost; a number >= 1. None: the backend's default.
    idle_timeout : float | None, default None
        The session's (see Session): seconds a running worker may sit idle (under 5 % of a core, its
        GPUs unused) before it is stopped; a number >= 1. None: never.
    ttl : float | None, default None
        The session's (see Session): seconds from its first launch after which its workers are stopped
        and it launches no more; a number >= 1. None: never.
    straggler_fraction : float | None, default 0.3
        The session's (see Session): a rank whose reported steps come this share slower than its peers'
        median over straggler_window seconds is named as a straggler; between 0 and 1. None: never.
    straggler_window : float, default 30
        The seconds a rank's pace is measured over; a number >= 1.
    **options : Any
        The backend's options: the keyword arguments of its class's constructor (e.g. ``hosts=``,
        ``user=`` for "ssh"). Not with a Backend instance: pass them to its class.

    Returns
    -------
    None

    Raises
    ------
    ConfigError
        Before anything starts: silence_timeout, idle_timeout or ttl is neither None nor a number >= 1, or a
        straggler setting is out of its range; the name
        is unknown or its backend cannot be imported; an option is one the backend does not take, or options
        come with a Backend instance; or the default session has workers already, finished ones included (call
        stop_session() first).

    Examples
    --------
    ::

        cdsw.use_backend("ssh", hosts=["10.0.0.5", "10.0.0.6:2"], user="alice", identity="~/.ssh/id_ed25519")
        cdsw.use_backend("local", silence_timeout=120)
        cdsw.use_backend(None)  # back to CMLCLUSTER_BACKEND, or "local"
    """
    global _backend, _backend_options
    check_silence_timeout(silence_timeout)
    check_idle_timeout_and_ttl(idle_timeout, ttl)
    check_stragglers(straggler_fraction, straggler_window)
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
    # The Session's own options, beside the backend's.
    session_options = {"silence_timeout": silence_timeout, "idle_timeout": idle_timeout, "ttl": ttl}
    _backend_options.update({k: v for k, v in session_options.items() if v is not None})
    stragglers = {"straggler_fraction": straggler_fraction, "straggler_window": straggler_window}
    defaults = {"straggler_fraction": STRAGGLER_FRACTION, "straggler_window": STRAGGLER_WINDOW}
    _backend_options.update({k: v for k, v in stragglers.items() if v != defaults[k]})


def _named(backend: str | Backend | None) -> str | Backend:
    """The backend chosen: the one given, else the one CMLCLUSTER_BACKEND names (default "local")."""
    return backend if backend is not None else os.environ.get("CMLCLUSTER_BACKEND", "local")


def get_session() -> Session:
    """The default session, started on first use.

    A new one starts whenever none is open (at first, or after stop_session()), on the backend and
    with the options use_backend chose, else on the backend CMLCLUSTER_BACKEND names (default "local").

    Returns
    -------
    Session
        The default session: the one the module functions (launch_workers, ...) and runs given no
        session or backend use.

    Raises
    ------
    ConfigError
        When a session starts: the name CMLCLUSTER_BACKEND gives is unknown, or its backend cannot be
        imported. Building the backend checks its options' values (ConfigError, mostly).

    Examples
    --------
    ::

        session = cdsw.get_session()
        display(session)  # in a notebook: the whole session's view
    """
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Session(_named(_backend), **_backend_options)
        return _default


def stop_session() -> None:
    """Stop the default session's workers and controller.

    Closes the default session, if one is open (Session.close: every worker, the controller and the
    session's loop are stopped, and the session's files removed). The next call that needs a
    session starts a new one, on the backend use_backend chose. Nothing happens when none is open.

    Returns
    -------
    None

    Examples
    --------
    ::

        cdsw.stop_session()  # a backend is chosen before the session has workers
        cdsw.use_backend("local", silence_timeout=120)
    """
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
    `%magic` lines), or with neither serves the control plane until stopped. Returns at once;
    await_workers waits for them. Runs on the default session (Session.launch_workers).

    Parameters
    ----------
    n : int
        How many workers: a whole number, 1 or more.
    cpu : float
        Cores per worker, a number above 0.
    memory : float
        Memory per worker, in GB, a number above 0.
    nvidia_gpu : int, default 0
        GPUs per worker, a whole number, 0 or more.
    kernel : str, default "python3"
        "python3" or "python": only Python workers are supported.
    script : str, default ""
        The path of a script each worker runs as ``__main__``; a relative one starts in the working
        folder (a notebook's is its own folder). Shipped to workers that cannot read it where it is.
    code : str, default ""
        Source each worker runs as an IPython cell (its common indentation dropped, `!cmd` and
        `%magic` lines allowed). Not with `script`: CML ignores code when a script is set.
    env : Mapping[str, str] | None, default None
        Variables added to each worker's environment: names of letters, digits and ``_``, not
        starting with a digit (those starting with ``CMLCLUSTER_`` are cmlcluster's own); values strings.
    name : str, default ""
        The workers' name, in their dicts, as CML's newer workspaces take it: one line of text, at
        most 200 characters.
    collect : str | Iterable[str] | None, default None
        Keyword only; not in CML, where every worker writes to the project's disk: paths under the
        worker's working folder ("outputs", "model.keras") that come to this working folder when it
        ends (Session.launch_workers). A single string is one path.

    Returns
    -------
    list[dict[str, Any]]
        One dict per worker, right away (status "scheduling"); a worker that could not be launched
        comes back as a dict without "id", with a "message".

    Raises
    ------
    ConfigError
        Before anything starts: n, cpu, memory or nvidia_gpu out of range; another kernel; both script
        and code; a script that is no file; a bad env, name or collect entry.

    Examples
    --------
    ::

        workers = cdsw.launch_workers(n=3, cpu=1, memory=1, code="import socket; print(socket.gethostname())")
        idle = cdsw.launch_workers(n=2, cpu=1, memory=2)  # no program: they serve until stopped
        cdsw.launch_workers(2, cpu=2, memory=4, script="train.py", collect=["outputs", "checkpoints/"])
    """
    return get_session().launch_workers(n, cpu, memory, nvidia_gpu, kernel, script, code, env, name, collect=collect)


def await_workers(
    ids: Iterable[str | Mapping[str, Any]],
    wait_for_completion: bool = True,
    timeout_seconds: float = 60,
) -> dict[str, list[dict[str, Any]]]:
    """Wait for workers to finish (or, with wait_for_completion=False, to run); 0 waits without a limit.

    Returns the moment the outcome is decided. Runs on the default session (Session.await_workers).

    Parameters
    ----------
    ids : Iterable[str | Mapping[str, Any]]
        The workers: their ids, or their dicts (as launch_workers returns them). A dict without "id"
        (a failed launch) comes back among the failures.
    wait_for_completion : bool, default True
        True: wait until every worker has finished. False: until every one is running.
    timeout_seconds : float, default 60
        Seconds to wait, a number >= 0; 0 waits without a limit.

    Returns
    -------
    dict[str, list[dict[str, Any]]]
        ``{"workers": [...], "failures": [...]}``. With wait_for_completion=True, "workers" holds those
        that succeeded; "failures" those that failed, were stopped, or had not finished by the deadline
        (status "timedout"). With False, "workers" holds those running; one that finished before it was
        seen running is a failure, and one not running by the deadline is "timedout".

    Raises
    ------
    ConfigError
        timeout_seconds is not a number >= 0, or an id is no worker of the default session.

    Examples
    --------
    ::

        workers = cdsw.launch_workers(n=3, cpu=1, memory=1, code="print('hello')")
        result = cdsw.await_workers(workers, wait_for_completion=True, timeout_seconds=60)
        # {"workers": [3 dicts with status "succeeded"], "failures": []}
    """
    return get_session().await_workers(ids, wait_for_completion, timeout_seconds)


def list_workers() -> list[dict[str, Any]]:
    """Every worker of the default session, finished ones included.

    Starts no session: before the default session has started, there are none.

    Returns
    -------
    list[dict[str, Any]]
        One dict per worker (Session.list_workers); a running worker's also says what it uses now.
    """
    return get_session().list_workers() if _default is not None else []


def stop_workers(*ids: str | Mapping[str, Any]) -> list[StopResponse]:
    """Stop these workers, or all of the default session's workers when none are named.

    In parallel; stopping a stopped worker does nothing. Starts no session: before the default
    session has started, nothing is stopped, and a worker named is refused as unknown.

    Parameters
    ----------
    *ids : str | Mapping[str, Any]
        The workers: their ids, or their dicts. None named: every worker of the default session.

    Returns
    -------
    list[StopResponse]
        One response per worker, as CML's: the worker's dict, with `status_code` and `ok`
        (Session.stop_workers).

    Raises
    ------
    ConfigError
        An id is no worker of the default session (or no session has started in this process).

    Examples
    --------
    ::

        cdsw.stop_workers()  # all of them
        cdsw.stop_workers(*workers)  # these, by their dicts
    """
    if _default is not None:
        return get_session().stop_workers(*ids)
    if ids:  # as a session refuses an id that is none of its workers
        first = ids[0].get("id") if isinstance(ids[0], Mapping) else ids[0]
        raise ConfigError(f"{first!r} is not a worker: no session runs in this process (launch_workers starts one)")
    return []


def xray(*ids: str | Mapping[str, Any]) -> XRay:
    """Where every rank of the default session's running workers is, right now.

    Each worker's agent reads the Python stack of every thread of its program and of every rank below
    it (torchrun's, Horovod's and JAX's processes; TensorFlow tasks run in the agent): through the
    faulthandler dump each rank armed as cmlcluster started it, and with py-spy (where it is installed
    and may attach) for any other Python process there. Nothing is stopped. Ranks with the same stack
    are grouped; the odd ones out are named with the line they stand at, and the others with the
    collective they wait in.

    Parameters
    ----------
    *ids : str | Mapping[str, Any]
        The workers: their ids, or their dicts. None named: every running worker of the default session.

    Returns
    -------
    XRay
        Printed, the text; displayed in a notebook, HTML. ``.odd_ones_out()``, ``.groups()`` and
        ``.rank(n)`` give the records (cmlcluster.xray).

    Examples
    --------
    ::

        print(cdsw.xray())
        cdsw.xray().rank(2).main.frames[-1]  # where rank 2 stands
    """
    return get_session().xray(*ids)


def tensorboard(logdir: str, port: int | None = None) -> Any:
    """TensorBoard on `logdir` for the default session (like cdsw_tensorflow_utils.tensorboard).

    Started on 127.0.0.1, and stopped with the session (Session.tensorboard).

    Parameters
    ----------
    logdir : str
        The folder training writes its event files to; it need not exist yet.
    port : int | None, default None
        The port on 127.0.0.1; None takes 6006 if free, else a free port.

    Returns
    -------
    Any
        A cmlcluster.tensorboard_server.TensorBoard; in a notebook it shows as a link.

    Raises
    ------
    ConfigError
        A bad argument, or no tensorboard package in this Python (before anything starts).
    CmlClusterError
        The port asked for is in use, no free port was found, or TensorBoard exits or does not answer
        in time.

    Examples
    --------
    ::

        cdsw.tensorboard("./distributed-mnist")
    """
    return get_session().tensorboard(logdir, port)


def client() -> Any:
    """The ipyparallel Client of the default session's workers (for %px and views).

    Returns
    -------
    Any
        The default session's Session.client: an ipyparallel Client, None before its first launch.

    Examples
    --------
    ::

        rc = cdsw.client()
        rc.activate()  # then %px runs on the workers
    """
    return get_session().client
