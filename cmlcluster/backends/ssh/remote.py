"""Runs on an SSH host, one per worker: ``python -m cmlcluster.backends.ssh.remote``, started over ssh.

It does on the host what the local backend does on the session's machine: it starts the
worker's agent in a process group of its own, in a private working folder (removed at the end),
with CPU and memory limits where the host's cgroups allow, and ends everything the worker started
when asked. The SSH backend talks to it through the ssh connection's stdin:

- the first line is the request, as JSON: the worker's argv, its environment (only what the
  session sends: the user's env= and cmlcluster's own, never on a command line where `ps`
  would show it), its id, resources and the session's silence_timeout;
- then the lines of ssh/relay.py: ``from <offset>``, ``stop <grace>`` (TERM to the worker's group
  and to everything below it, as an sshd's logins start sessions of their own; KILL after grace
  seconds), ``bye``; input that ends while the connection holds stops the worker, as the session
  that ends does.

The worker does not die with its ssh connection: this process forks the worker's relay
(ssh/relay.py) out of the ssh login, and then only carries the connection between the two. When
the connection drops, the relay keeps the worker and its output, and the session connects again
with ``python -m cmlcluster.backends.ssh.remote --attach <worker id>``, which finds the relay's
socket in the worker's folder (0700) and carries a connection the same way. The worker's output
(its stdout and stderr, as one stream) and its exit code (128+N when a signal N killed it) reach
the session in the relay's frames.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import select
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..._proc import descendants, end_group
from ...cgroups import CgroupLimits
from ...wire import DEFAULT_SILENCE_TIMEOUT, READ_CHUNK
from .janitor import Janitor
from .relay import FRAME_BYTES, GONE_EXIT, HANGUP_MS, POLL_MS, SOCKET_NAME, Relay, end_worker_on_signals

DEFAULT_GRACE = 5.0
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# What a worker keeps of the login's environment on its host: the host's own, never the session's.
LOGIN_VARIABLES = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL")


def _become_subreaper() -> None:
    """Orphans of the worker (its agent died first) become this process's children, so none escapes."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _end(process: subprocess.Popen[bytes], grace: float) -> None:
    """TERM the worker's group and everything below this process (an sshd's logins leave the group);
    KILL what is left after grace. Reaped by the relay's waiting thread: this may run in a signal handler."""
    end_group(process, grace, others=lambda: descendants(os.getpid()), reap=False)


def _read_request(fd: int) -> tuple[dict[str, Any], bytes]:
    """The request line from `fd`, and what came after it (the session's first lines, for the relay).
    Read from the descriptor, never through sys.stdin, whose buffer would keep what follows."""
    data = bytearray()
    while b"\n" not in data:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            sys.exit("cmlcluster: the session sent no request")
        data += chunk
    line, _, rest = bytes(data).partition(b"\n")
    return json.loads(line), rest


def run_worker(request: dict[str, Any], folder: str, listener: socket.socket, first: socket.socket) -> int:
    """The relay's side: the worker's agent started in `folder`, relayed until its end; its exit code."""
    worker_id = str(request["worker_id"])
    started = time.time()  # what the worker changes from now on is its own (results.changed)
    relay = Relay(first, listener, float(request.get("silence_timeout") or DEFAULT_SILENCE_TIMEOUT))
    end_worker_on_signals(relay)
    limits = CgroupLimits(f"cmlcluster-{worker_id}", float(request["cpu"]), float(request["memory"]))
    argv = [sys.executable, *request["argv"][1:]]  # the interpreter this runs on is the worker's
    code = 1
    temporary = ""
    janitor = Janitor(limits)  # cleans what this leaves should it be killed: before the subreaper (ssh_janitor)
    janitor.remove(folder)
    _become_subreaper()
    try:
        env = {k: os.environ[k] for k in LOGIN_VARIABLES if k in os.environ}
        env.update(request["env"])
        # Removed with the worker's folder, at its end (by the janitor if this is killed).
        env["TMPDIR"] = temporary = janitor.remove(short_tmpdir())
        work = os.path.join(folder, "work")
        os.mkdir(work)
        read_end, write_end = os.pipe()
        try:
            # Its stderr joins its stdout: two streams arrive in either order, and a worker's last words
            # (a traceback) must come after what it printed before them, as they do locally.
            process = subprocess.Popen(
                argv, env=env, cwd=work, stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            os.close(read_end)
            relay.never_started(f"could not start the worker ({shlex.join(argv)}): {e}")
        else:
            limits.add(process.pid)
            janitor.group(process.pid)
            relay.watch(process, read_end, lambda grace: _end(process, grace))
        finally:
            os.close(write_end)
        code = relay.run()
    finally:
        relay.end_worker(0)  # nothing of the worker outlives its relay, even one that failed
        limits.remove()
        from ...collect.on_host import keep  # here, at the worker's end: its imports are 5 ms of every worker's start

        keep(os.path.join(folder, "work"), worker_id, request.get("collect", ()), started)  # for the session
        shutil.rmtree(folder, ignore_errors=True)
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
        janitor.done()
    return code


# The longest TMPDIR a worker's temporary folder is made in: 107 bytes of a Unix socket's path, less
# Ray's 70 under it (ray/session_<time>_<pid>/sockets/plasma_store) and cml-<8>.
SHORT_TMPDIR_BASE = 107 - 70 - 13


def short_tmpdir() -> str:
    """A private temporary folder for one worker, with a short path: programs make Unix sockets in
    TMPDIR, and a socket's path has 107 bytes at most (Ray's are 70 bytes under it). The worker's own
    folder (cmlcluster-<worker id>-<random>/tmp) would leave too few of them, and so may a long TMPDIR
    of the host's login: then it is made in /tmp."""
    base = tempfile.gettempdir()
    if len(base) > SHORT_TMPDIR_BASE and os.access("/tmp", os.W_OK):  # noqa: S108 (a private mkdtemp in it)
        base = "/tmp"  # noqa: S108
    return tempfile.mkdtemp(prefix="cml-", dir=base)  # 0700: only this user


def _leave_the_login() -> None:
    """The relay in a session of its own, holding none of the login's descriptors: sshd ends a login once
    nothing holds its pipes, and the relay outlives it."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def main() -> None:
    if sys.argv[1:2] == ["--attach"]:
        sys.exit(attach(sys.argv[2] if len(sys.argv) > 2 else ""))
    request, pending = _read_request(0)
    folder = tempfile.mkdtemp(prefix=f"cmlcluster-{request['worker_id']}-")  # 0700: only this user
    try:
        os.chdir(folder)  # the socket is bound by its name in the folder: a long TMPDIR is no matter
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(SOCKET_NAME)
        listener.listen(4)
        listener.setblocking(False)
        ours, relays = socket.socketpair()
        relay_pid = os.fork()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if relay_pid == 0:
        code = 1
        try:
            ours.close()
            _leave_the_login()
            code = run_worker(request, folder, listener, relays)
        finally:
            os._exit(code)
    listener.close()
    relays.close()
    sys.exit(bridge(ours, pending))


def bridge(sock: socket.socket, pending: bytes = b"") -> int:
    """Join this process's stdin and stdout (an ssh login's) to a relay's socket, both ways, until the relay
    closes it. Input that ends while the output still holds is the session closing it (`closed`); input and
    output ending together is the connection dropping: the socket closes and the worker goes on."""
    sock.setblocking(False)
    os.set_blocking(1, False)
    to_relay, to_session = bytearray(pending), bytearray()
    stdin_open, relay_open = True, True
    poller = select.poll()
    while True:
        fds = {1: select.POLLOUT if to_session else 0}
        if relay_open:
            fds[sock.fileno()] = (select.POLLIN if len(to_session) < 4 * FRAME_BYTES else 0) | (
                select.POLLOUT if to_relay else 0
            )
        if stdin_open:
            fds[0] = select.POLLIN
        for fd, mask in fds.items():
            poller.register(fd, mask)
        events = dict(poller.poll(POLL_MS))
        for fd in fds:
            poller.unregister(fd)
        if events.get(1, 0) & (select.POLLERR | select.POLLHUP):
            return 0  # the login is gone
        if events.get(0):
            data = os.read(0, READ_CHUNK)
            if data:
                to_relay += data
            elif _output_breaks():
                return 0  # the connection dropped: input and output went together
            else:
                stdin_open = False
                to_relay += b"closed\n"
        relay_events = events.get(sock.fileno(), 0) if relay_open else 0
        try:
            if relay_events & select.POLLOUT and to_relay:
                del to_relay[: sock.send(to_relay)]
            if relay_events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                data = sock.recv(READ_CHUNK)
                to_session += data
                relay_open = bool(data)
        except BlockingIOError:
            pass
        except OSError:  # the relay went (it ended, or took a newer connection): what it said is all
            relay_open = False
        if to_session and events.get(1, 0) & select.POLLOUT:
            try:
                del to_session[: os.write(1, to_session)]
            except BlockingIOError:
                pass
            except OSError:
                return 0  # the login is gone
        if not relay_open:
            return _flush_then_end(to_session)


def _output_breaks() -> bool:
    """Whether stdout's reader goes within HANGUP_MS: sshd exiting closes all of a login's pipes at once."""
    check = select.poll()
    check.register(1, 0)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in check.poll(HANGUP_MS))


def _flush_then_end(data: bytearray) -> int:
    """What the relay sent last, written out if the login takes it within a second: a relay that ended a
    connection (it replaced it, or is gone) does not wait on it."""
    deadline = time.monotonic() + 1.0
    while data and time.monotonic() < deadline:
        if select.select([], [1], [], max(0.0, deadline - time.monotonic()))[1]:
            try:
                del data[: os.write(1, data)]
            except BlockingIOError:
                continue
            except OSError:
                break
    return 0


def attach(worker_id: str) -> int:
    """Carry a new connection to the relay of `worker_id` on this host (GONE_EXIT when there is none)."""
    if not re.fullmatch(r"[\w.-]+", worker_id):
        print(f"cmlcluster: {worker_id!r} is not a worker id", file=sys.stderr)
        return 2
    pattern = os.path.join(glob.escape(tempfile.gettempdir()), f"cmlcluster-{worker_id}-*")
    for folder in glob.glob(pattern):
        info = os.lstat(folder)
        # Not one this user's worker made, or one others can reach. Only the access bits are asked: a folder
        # made in a setgid folder (a group's shared TMPDIR) is 2700, as private as 0700.
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.chdir(folder)
            sock.connect(SOCKET_NAME)
        except OSError:
            sock.close()
            continue
        return bridge(sock)
    print(
        f"cmlcluster: worker {worker_id} is no longer on this host: it ended, and no connection came for its "
        "exit code within its silence_timeout",
        file=sys.stderr,
    )
    return GONE_EXIT


if __name__ == "__main__":
    main()
