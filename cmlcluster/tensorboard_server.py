"""TensorBoard for a session: ``TensorBoard.start("./distributed-mnist")``.

Like Cloudera's ``cdsw_tensorflow_utils.tensorboard(logdir)``: a TensorBoard
server on the training's log folder, as a child of this process, shown in the
notebook as a link.

- It listens on 127.0.0.1 only (never ``--bind_all``): whoever reaches it can
  read every log under `logdir`, so it is reached through this machine, or
  through the notebook server's jupyter-server-proxy (see `browser_url`).
- It serves only under a path of a random token, new at each start
  (``http://127.0.0.1:PORT/TOKEN/``): every user of this machine reaches
  127.0.0.1, and without the token gets 404. A link shown before a stop leads
  nowhere after it, whatever binds the port next (another TensorBoard has
  another token). The token reaches TensorBoard in a 0600 flag file, removed
  once it answers, never on its command line. It listens on that one port:
  ``--load_fast=false`` keeps it from starting its data server, which would
  serve every log under `logdir` on another port of 127.0.0.1, without the token.
- It runs in a process group of its own under a lifeline (_lifeline.py): when
  this process ends, however it ends (kill -9 included), the group is killed.
- Its output goes to a log file, never to the notebook: in `session_dir` when
  given (kept; the session removes its folder), else a private temp file removed
  by `stop()`.

It runs until `stop()`, the end of a ``with`` block, or the end of this Python
process (the module holds a reference to every running TensorBoard, so dropping
yours does not kill it by garbage collection). How its process is launched,
probed and ended is in tensorboard_process.py.
"""

from __future__ import annotations

import atexit
import contextlib
import html
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from types import TracebackType
from typing import Any

from . import checks
from .apps import server_proxy
from .errors import CmlClusterError, ConfigError
from .tensorboard_process import (
    HOST,
    PORT_IN_USE,
    SERVING,
    answers,
    child_pid,
    end_group,
    free_port,
    hint,
    launch,
    new_prefix,
    port_free,
    quote_log,
    read_from,
    write_flags,
)

__all__ = ["DEFAULT_PORT", "TensorBoard"]

DEFAULT_PORT = 6006  # TensorBoard's own default, taken when free
BIND_ATTEMPTS = 5  # free ports tried when another process takes the one picked first
POLL_INTERVAL = 0.2

_running: set[TensorBoard] = set()
_atexit_lock = threading.Lock()
_atexit_registered = False


class TensorBoard:
    """A TensorBoard server on `logdir`, reached at `url` (http://127.0.0.1:PORT/TOKEN/).

    Made by `TensorBoard.start`, never directly. `poll()` is None while the server
    runs and its exit code after (the lifeline's: 0 after a clean TERM, -9 after a
    KILL); `stop()` is idempotent.
    """

    def __init__(
        self,
        *,
        logdir: str,
        port: int,
        process: subprocess.Popen[bytes],
        log_path: str,
        own_log: bool,
        prefix: str = "",
    ):
        self._logdir = logdir
        self._port = port
        self._prefix = prefix  # the path it serves under: "/" and the token
        self._process = process  # the lifeline; its pid is the process group's id
        self._log_path = log_path
        self._own_log = own_log  # a private temp file: removed by stop()
        self._pid = process.pid  # TensorBoard's own pid once it answers
        self._stopped = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- start

    @classmethod
    def start(
        cls,
        logdir: str | os.PathLike[str],
        *,
        port: int | None = None,
        session_dir: str | None = None,
        timeout: float = 60,
    ) -> TensorBoard:
        """Start TensorBoard on `logdir` and return once it answers HTTP.

        logdir: the folder training writes its event files to (TensorBoard walks it
            recursively). It need not exist yet: TensorBoard shows it once written.
            A URL such as gs://bucket/logs is passed as it is.
        port: the port on 127.0.0.1; None takes 6006 if free, else a free port.
        session_dir: a folder for TensorBoard's log file (a session's folder); None
            writes it to a private temp file that `stop()` removes.
        timeout: seconds to wait for TensorBoard to answer (it imports TensorFlow
            first: a few seconds).

        Raises ConfigError for a bad argument or a missing tensorboard package
        (before anything starts), CmlClusterError when TensorBoard exits or does not
        answer in time (quoting its log; whatever started is stopped first).
        """
        logdir = _check_logdir(logdir)
        if port is not None and not checks.port(port):
            raise ConfigError(f"port={port!r} is not a TCP port: pass an int from 1 to 65535, or None to pick one")
        if session_dir is not None and not (isinstance(session_dir, str) and os.path.isdir(session_dir)):
            raise ConfigError(f"session_dir={session_dir!r} is not an existing folder: pass one, or None")
        if not checks.number(timeout, above=0):
            raise ConfigError(f"timeout={timeout!r} must be a number of seconds above 0")
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                f"TensorBoard is not installed in this Python ({sys.executable}): "
                "pip install tensorboard (TensorFlow brings it), then restart the kernel"
            )
        if port is not None and not port_free(port):
            raise CmlClusterError(
                f"port {port} on {HOST} is in use (another TensorBoard?): pass another port, or port=None to pick one"
            )

        if session_dir is not None:
            fd, log_path = tempfile.mkstemp(prefix="tensorboard-", suffix=".log", dir=session_dir)
        else:
            # The cmlcluster- prefix puts it among the temp folders the test suite checks for leaks.
            fd, log_path = tempfile.mkstemp(prefix="cmlcluster-tensorboard-", suffix=".log")
        prefix = new_prefix()
        flagfile = ""
        deadline = time.monotonic() + timeout
        chosen = port
        try:
            flagfile = write_flags(session_dir, prefix)
            for attempt in range(1, BIND_ATTEMPTS + 1):
                if chosen is None:
                    chosen = DEFAULT_PORT if attempt == 1 and port_free(DEFAULT_PORT) else free_port()
                log_from = os.fstat(fd).st_size  # this attempt's output starts here
                board = cls(
                    logdir=logdir,
                    port=chosen,
                    process=launch(logdir, chosen, fd, flagfile),
                    log_path=log_path,
                    own_log=session_dir is None,
                    prefix=prefix,
                )
                _keep(board)
                try:
                    if board._wait_ready(deadline, log_from):
                        return board
                except BaseException:
                    board.stop()  # also removes a private log: the error quotes it first
                    raise
                # Another process took the port between our check and TensorBoard's bind.
                board._stop(remove_log=False)
                if port is not None:
                    raise CmlClusterError(
                        f"TensorBoard could not bind to port {port} on {HOST}: it is in use; "
                        "pass another port, or port=None to pick one"
                    )
                chosen = None
            raise CmlClusterError(
                f"TensorBoard found no free port on {HOST} in {BIND_ATTEMPTS} tries (other processes took each first)"
                + quote_log(log_path, 0, shown=session_dir is not None)
            )
        except BaseException:
            if session_dir is None:
                with contextlib.suppress(OSError):
                    os.remove(log_path)
            raise
        finally:
            os.close(fd)
            if flagfile:  # read as TensorBoard started: it answers, or is gone
                with contextlib.suppress(OSError):
                    os.remove(flagfile)

    def _wait_ready(self, deadline: float, log_from: int) -> bool:
        """True once TensorBoard holds the port and answers GET / (False: the port was taken first).

        It counts as ready only when its own log says it holds the port: another
        server answering on a port it failed to bind (a TensorBoard started at the
        same moment, both finding 6006 free) must not pass for it.
        """
        serving = SERVING.format(host=HOST, port=self._port, prefix=self._prefix)
        while True:
            code = self._process.poll()
            text = read_from(self._log_path, log_from)
            if code is not None:
                if PORT_IN_USE in text:
                    return False
                raise CmlClusterError(
                    f"TensorBoard on {self._logdir!r} exited with code {code} before answering on {self.url}"
                    + quote_log(self._log_path, log_from, shown=not self._own_log)
                    + hint(text)
                )
            wait = max(0.1, min(2.0, deadline - time.monotonic()))
            if serving in text and answers(self._port, timeout=wait, prefix=self._prefix):
                self._pid = child_pid(self._process.pid) or self._process.pid
                return True
            if time.monotonic() > deadline:
                raise CmlClusterError(
                    f"TensorBoard on {self._logdir!r} did not answer on {self.url} in time "
                    "(pass a larger timeout= if this machine is busy)"
                    + quote_log(self._log_path, log_from, shown=not self._own_log)
                )
            time.sleep(POLL_INTERVAL)

    # ------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT/TOKEN/: reachable from this machine only, by whoever knows the token."""
        return f"http://{HOST}:{self._port}{self._prefix}/"

    @property
    def port(self) -> int:
        return self._port

    @property
    def logdir(self) -> str:
        """The absolute folder (or URL) TensorBoard reads."""
        return self._logdir

    @property
    def pid(self) -> int:
        """TensorBoard's own process; its group (it and the lifeline) is led by the lifeline."""
        return self._pid

    @property
    def log_path(self) -> str:
        """TensorBoard's output (a private temp file is gone after `stop()`)."""
        return self._log_path

    @property
    def browser_url(self) -> str:
        """The URL a browser opens: through the notebook server when it can proxy, else `url`.

        - $TENSORBOARD_PROXY_URL, TensorBoard's own setting (its %PORT% replaced),
          as Jupyter's docker-stacks images set it, then the token;
        - else, in a kernel of a notebook server with jupyter-server-proxy installed,
          ``{prefix}proxy/{port}/{token}/`` with that server's base URL (server_proxy.base_url), as
          workers' app_url; outside one (a script, a console) there is no server to go through.
          That form strips ``{prefix}proxy/{port}`` before TensorBoard sees the
          request, which then begins with the token TensorBoard serves under; its
          page loads everything by relative URL, and the trailing slash is needed
          for those.
        """
        template = os.environ.get("TENSORBOARD_PROXY_URL")
        if template:
            return template.replace("%PORT%", str(self._port)).rstrip("/") + self._prefix + "/"
        base = server_proxy.base_url()
        if base is not None and server_proxy.installed():
            return server_proxy.url(HOST, self._port, self._prefix, prefix=base)
        return self.url

    # ------------------------------------------------------------- lifecycle

    def poll(self) -> int | None:
        """None while running, else the exit code (see the class docstring)."""
        return self._process.poll()

    def stop(self) -> None:
        """TERM TensorBoard, KILL its whole group after 5 s, wait, remove the private log. Idempotent."""
        self._stop(remove_log=self._own_log)

    def _stop(self, remove_log: bool) -> None:
        with self._lock:
            if not self._stopped:
                self._stopped = True
                end_group(self._process)
                _running.discard(self)
        if remove_log:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._log_path)

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running" if self.poll() is None else f"exited {self.poll()}"
        return f"<TensorBoard {self.url} logdir={self._logdir!r} pid={self._pid} {state}>"

    def _repr_html_(self) -> str:
        logdir = html.escape(self._logdir)
        if self._stopped or self.poll() is not None:
            return f"<span>TensorBoard on <code>{logdir}</code> (stopped)</span>"
        url = html.escape(self.browser_url, quote=True)
        return f'<a href="{url}" target="_blank" rel="noopener">TensorBoard</a> on <code>{logdir}</code>'


# -------------------------------------------------------------------- helpers


def _check_logdir(logdir: Any) -> str:
    if isinstance(logdir, os.PathLike):
        logdir = os.fspath(logdir)
    if not isinstance(logdir, str) or not logdir.strip():
        raise ConfigError(
            f"logdir={logdir!r} is not a folder name: pass the folder your training writes its logs to, "
            "e.g. TensorBoard.start('./logs')"
        )
    if "://" in logdir:  # gs://, s3://, hdfs://: TensorBoard reads those itself
        return logdir
    path = os.path.abspath(os.path.expanduser(logdir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"logdir={logdir!r} is a file, not a folder: pass the folder that holds the event files")
    return path


def _keep(board: TensorBoard) -> None:
    """Hold a reference until stop(), and stop what is left when Python exits normally."""
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_stop_all)
            _atexit_registered = True
        _running.add(board)


def _stop_all() -> None:
    for board in list(_running):
        board.stop()
