"""A live session's stop endpoint: how the JupyterLab panel stops a session's workers from outside.

Core, not the panel's: the session serves it (records.Recorder) and the panel's server extension
(lab/sessions.py) is one client of it, so the core never imports the panel.

The panel's server extension runs in the Jupyter server's process, and a session's workers are its
own process's to stop (its supervisor is the only writer of a worker's status). So each session serves
a Unix socket, `control.sock` in its private folder (0700, removed at close, and by the controller's
lifeline after a kill), on a daemon thread of its own process; its record names the path.

Who may ask: only the session's user. The folder's mode keeps other users from reaching the socket, and
each connection's peer is checked with SO_PEERCRED (the kernel's word on the connecting process's uid):
any other uid, root included, is refused. The client checks the server's uid the same way. Where the
system has no SO_PEERCRED (not Linux), no endpoint is served: the panel then shows sessions without Stop.

What may be asked: one JSON object of at most MAX_REQUEST bytes on one line per connection, and only
{"stop": "all"} or {"stop": ["<worker id>", ...]}: no other key, no other verb, nothing that names code
or a path. The reply is one line, {"stopping": [ids]} (the workers that had not ended, now being
stopped as the session's own stop_workers_soon stops them: TERM, then KILL after its grace) or
{"error": "..."}.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from .errors import CmlClusterError, ConfigError

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
MAX_REQUEST = 64 << 10  # enough for thousands of worker ids
READ_TIMEOUT = 5.0  # seconds a client has to send its request: a silent one never holds the thread long
MAX_SOCKET_PATH = 107  # sun_path's size on Linux, less its NUL
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def supported() -> bool:
    """Whether this system tells a Unix socket's peer uid (SO_PEERCRED: Linux)."""
    return hasattr(socket, "SO_PEERCRED") and hasattr(socket, "AF_UNIX")


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


# A stop request: None for every worker of the session, else those ids. Returns the ids being stopped;
# raises ConfigError (sent back as the error) for an id that is no worker of the session.
StopFunction = Callable[[list[str] | None], list[str]]


class StopEndpoint:
    """The socket at `path`, served until close(): each request calls `stop` (see StopFunction)."""

    def __init__(self, path: str, stop: StopFunction):
        if not supported():
            raise OSError("this system does not tell a Unix socket's peer (no SO_PEERCRED): no stop endpoint")
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise OSError(f"{path} is longer than a Unix socket's path may be ({MAX_SOCKET_PATH} bytes)")
        self.path = path
        self._stop = stop
        self._uid = os.geteuid()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._server.bind(path)
            os.chmod(path, 0o600)  # the folder (0700) already keeps others out; this says so at the socket too
            self._server.listen(8)
        except BaseException:
            self._server.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="cmlcluster-stop-endpoint", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and remove the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() in the thread (Linux)
        self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._thread is not threading.current_thread():
            self._thread.join(READ_TIMEOUT + 1)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                if self._closed:
                    return
                continue  # a connection that went before it was accepted (ECONNABORTED)
            with conn:
                try:
                    self._answer(conn)
                except Exception:  # one bad connection never ends the endpoint
                    log.exception("cmlcluster: the stop endpoint %s failed a request", self.path)

    def _answer(self, conn: socket.socket) -> None:
        uid = peer_uid(conn)
        if uid != self._uid:
            log.warning("cmlcluster: the stop endpoint %s refused a process of uid %d (not yours)", self.path, uid)
            _send(conn, {"error": f"refused: uid {uid} is not the session's user"})
            _discard(conn)
            return
        conn.settimeout(READ_TIMEOUT)
        try:
            ids = parse(_receive(conn))
            reply: dict[str, object] = {"stopping": self._stop(ids)}
        except CmlClusterError as e:
            reply = {"error": str(e)}
        except TimeoutError:
            reply = {"error": f"no request within {READ_TIMEOUT:g} s"}
        _send(conn, reply)


def parse(data: bytes) -> list[str] | None:
    """The workers a request asks to stop (None: all of them); ConfigError for anything but a stop request."""
    try:
        request = json.loads(data)
    except ValueError as e:
        raise ConfigError(f'not a JSON request ({e}): send {{"stop": "all"}} or {{"stop": [ids]}}') from None
    if not isinstance(request, dict) or set(request) != {"stop"}:
        raise ConfigError('the only request is {"stop": "all"} or {"stop": ["<worker id>", ...]}')
    ids = request["stop"]
    if ids == "all":
        return None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ConfigError(f'"stop": {ids!r}: give "all" or a list of worker ids (strings)')
    return ids


def request(path: str, ids: list[str] | None, timeout: float = READ_TIMEOUT) -> list[str]:
    """Ask the session serving `path` to stop these workers (None: all); the ids being stopped.

    Refuses (OSError) a socket served by another uid, and a reply that is not a stop endpoint's;
    ConfigError with the session's own error."""
    message = {"stop": "all" if ids is None else list(ids)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        uid = peer_uid(sock)
        if uid != os.geteuid():
            raise OSError(f"{path} is served by uid {uid}, not by you: not a session of yours")
        sock.sendall(json.dumps(message).encode() + b"\n")
        answer = _receive(sock)
    try:
        reply = json.loads(answer)
    except ValueError:  # an OSError as for any endpoint that does not answer as one: the caller's 404, not a 500
        raise OSError(f"{path} answered {answer[:200]!r}, not JSON: not a stop endpoint of cmlcluster") from None
    if not isinstance(reply, dict):
        raise OSError(f"{path} answered {reply!r}, not a stop endpoint's reply")
    if "error" in reply:
        raise ConfigError(str(reply["error"]))
    return [str(i) for i in reply.get("stopping", [])]


def _receive(conn: socket.socket) -> bytes:
    """One line (its newline dropped), or all until the peer closes; ConfigError past MAX_REQUEST bytes."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ConfigError(f"a request of more than {MAX_REQUEST} bytes: refused")
    return data.partition(b"\n")[0]


def _discard(conn: socket.socket) -> None:
    """Read what a refused peer sent, unparsed, until it closes (a second at most): Linux resets a Unix
    socket closed with unread data, and the peer's reset would lose the reply that says why."""
    deadline = time.monotonic() + 1.0
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            if not conn.recv(4096):
                return


def _send(conn: socket.socket, reply: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # the client left: nothing to tell
        conn.sendall(json.dumps(reply).encode() + b"\n")
