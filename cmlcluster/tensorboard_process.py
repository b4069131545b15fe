"""TensorBoard's process, below the TensorBoard object: how it is launched, probed, and ended.

It is launched in a process group of its own under a lifeline (_lifeline.py), so that
the group is killed when this process ends, however it ends; it listens on 127.0.0.1
only, on one port (--load_fast=false: no data server of its own on another), under a
path of a random token (--path_prefix, read from a 0600 flag file, never from its
command line, which every user may read); it counts as ready once its log says it holds
the port and it answers HTTP there; it is ended by TERM to the lifeline, then KILL to
what is left of the group. The helpers here also pick ports and quote its log in errors.
"""

from __future__ import annotations

import http.client
import secrets
import socket
import subprocess
import sys
import tempfile

from . import _lifeline, _proc
from ._proc import descendants

HOST = "127.0.0.1"
RELOAD_INTERVAL = 5  # seconds between TensorBoard's scans of the logdir
STOP_GRACE = 5.0  # seconds between TERM and KILL
LOG_LINES = 20  # quoted in errors

# TensorBoard prints these (tensorboard/program.py); the first only once it holds the port.
SERVING = "at http://{host}:{port}{prefix}/"
PORT_IN_USE = "could not bind to port"


def new_prefix() -> str:
    """A path that TensorBoard serves under, and nothing else: who does not know it gets 404 (128 random bits)."""
    return "/" + secrets.token_urlsafe(16)


def write_flags(directory: str | None, prefix: str) -> str:
    """A new flag file (0600, in `directory` or the temp folder) that gives TensorBoard its path prefix
    (absl reads `--flagfile` as TensorBoard starts); its path."""
    fd, path = tempfile.mkstemp(prefix="cmlcluster-tensorboard-", suffix=".flags", dir=directory)
    with open(fd, "w") as f:
        f.write(f"--path_prefix={prefix}\n")
    return path


def launch(logdir: str, port: int, log_fd: int, flagfile: str) -> subprocess.Popen[bytes]:
    """TensorBoard on `logdir` at HOST:port, with the flags in `flagfile` (write_flags), its output into
    log_fd; the process returned is its lifeline."""
    argv = [
        *_proc.python_module("tensorboard.main"),  # the notebook's folder not on its sys.path
        f"--logdir={logdir}",
        f"--host={HOST}",
        f"--port={port}",
        f"--reload_interval={RELOAD_INTERVAL}",
        # Not its Rust data server (`--load_fast=auto` starts one where tensorboard-data-server is installed):
        # that listens on another port of 127.0.0.1, found in /proc/net/tcp by every user, and serves every
        # log under logdir over gRPC without the token or any other check.
        "--load_fast=false",
        f"--flagfile={flagfile}",
    ]
    # Its own process group under a lifeline: stdin is a pipe whose only write end
    # this process holds (non-inheritable), so when this process ends, the group is killed.
    process = subprocess.Popen(
        [sys.executable, _lifeline.__file__, "--", *argv],
        stdin=subprocess.PIPE,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _lifeline.guard_stdin(process)
    return process


def end_group(process: subprocess.Popen[bytes]) -> None:
    """TERM TensorBoard (it then removes its own temp files), KILL what is left of the group after the grace, reap."""
    # The TERM to the lifeline only, which passes it on once: TensorBoard takes a second TERM as the
    # order to die at once, skipping its cleanup (so no TERM to the whole group).
    _proc.end_group(process, STOP_GRACE, leader_only=True)
    assert process.stdin is not None
    process.stdin.close()


def child_pid(parent: int) -> int | None:
    """The direct child of `parent` (the lifeline runs one: TensorBoard)."""
    for pid in descendants(parent):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) == parent:
                    return pid
        except (OSError, ValueError, IndexError):
            continue
    return None


def port_free(port: int) -> bool:
    """Whether TensorBoard could bind `port` on 127.0.0.1 now (as it does: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 now; another process may take it before TensorBoard does (start retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def answers(port: int, timeout: float, prefix: str = "") -> bool:
    """GET prefix/ on 127.0.0.1:port returns 200 and a TensorBoard page (http.client: no proxy from the environment)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        connection.request("GET", prefix + "/")
        response = connection.getresponse()
        return response.status == 200 and b"tensorboard" in response.read().lower()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def read_from(path: str, offset: int) -> str:
    """What TensorBoard wrote to its log at `path` since `offset` ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def quote_log(path: str, offset: int, shown: bool) -> str:
    """The last lines TensorBoard wrote since `offset`; the path only when the file is kept (`shown`)."""
    where = f" ({path})" if shown else ""
    lines = read_from(path, offset).splitlines()[-LOG_LINES:]
    if not lines:
        return f"; its log{where} is empty"
    return f". Last lines of its log{where}:\n" + "\n".join("    " + line for line in lines)


def hint(text: str) -> str:
    """What to do about a failure TensorBoard's log shows, when it is a known one."""
    if "No module named 'tensorboard" in text:
        return f"\nTensorBoard is not importable in {sys.executable}: pip install tensorboard"
    if "Permission denied" in text:
        return "\nTensorBoard cannot read the logdir: check its permissions"
    return ""
