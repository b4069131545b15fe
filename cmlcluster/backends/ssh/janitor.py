"""Cleans up after a worker's relay on an SSH host that was killed (kill -9, the OOM killer).

The relay (ssh_remote.run_worker) removes the worker's folder, its short TMPDIR (/tmp/cml-…) and its
cgroups itself, in a `finally` that a SIGKILL never reaches. So before it starts the worker it forks a
janitor: a process of its own session, not below the relay (it never gets the relay's stop), holding
the read end of a pipe whose only write end the relay holds. The relay tells it, in lines, what to
clean (`remove <folder>`, `group <pgid> <start time>`) and, once it has cleaned up itself, `done`.
When the pipe ends without `done`, the relay died: the janitor ends what is left of the worker's
process group, then SIGKILLs what is left in its cgroups (processes that left the group: setsid
children, logins to a worker's sshd; and a worker started before the janitor learned its group) and,
where the host gives no cgroups, every process whose TMPDIR is one of the worker's folders (the
worker's short TMPDIR, which its children inherit), then removes the cgroups and the folders. Either
way it then exits.

Light imports only: it runs in every worker's relay.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable

from ..._proc import group_members, signal_group
from ...cgroups import CgroupLimits
from ...origin import start_time

GRACE = 5.0  # seconds between TERM and KILL to a killed relay's worker, as the relay's own stop gives


class Janitor:
    """The relay's side: made before the worker starts (and before the relay becomes a subreaper,
    which would make the janitor its child again); told what to clean, then `done()`."""

    def __init__(self, limits: CgroupLimits):
        read_end, self._write_end = os.pipe()  # not inherited by the worker: os.pipe()'s are close-on-exec
        first = os.fork()
        if first == 0:  # the middle child: it leaves at once, so the janitor is nobody's child here
            try:
                if os.fork() == 0:
                    _serve(read_end, limits)
            finally:
                os._exit(0)
        os.close(read_end)
        os.waitpid(first, 0)

    def remove(self, folder: str) -> str:
        """`folder` is removed should the relay die before it removed it; returns it."""
        self._say(f"remove {folder}")
        return folder

    def group(self, pgid: int) -> None:
        """The worker's process group, ended should the relay die while it runs."""
        self._say(f"group {pgid} {start_time(pgid)}")

    def done(self) -> None:
        """The relay cleaned up: the janitor has nothing to do. Idempotent."""
        self._say("done")
        with contextlib.suppress(OSError):
            os.close(self._write_end)

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError):  # a janitor that is gone (killed) cleans nothing more
            os.write(self._write_end, line.encode() + b"\n")


def _serve(read_end: int, limits: CgroupLimits) -> None:
    """The janitor: wait for the relay's end, then clean what it left. Never returns."""
    try:
        os.setsid()  # a signal to the relay's group or session is not for it
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the relay's handlers (fork keeps them) would stop a relay
        _close_all_but(read_end)  # the pipe's write end and the relay's sockets: the relay's alone
        said = bytearray()
        while chunk := os.read(read_end, 4096):
            said += chunk
        lines = said.decode(errors="replace").splitlines()
        if "done" not in lines:
            _clean(lines, limits)
    finally:
        os._exit(0)


def _clean(lines: list[str], limits: CgroupLimits) -> None:
    folders = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "remove":
            folders.append(rest)
        elif word == "group":
            pgid, _, started = rest.partition(" ")
            _end_group(int(pgid), started)
    _end_cgroups(limits.paths)
    _end_marked({f"TMPDIR={folder}".encode() for folder in folders})
    limits.remove()  # empty now: rmdir succeeds
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _end_group(pgid: int, started: str) -> None:
    """TERM, then KILL after GRACE, what is left of the worker's group. A live process of that pid that
    started at another time means the group is gone and its number someone else's now (Linux gives no
    new process a pid that names a group with members): nothing is sent then."""
    now = start_time(pgid)
    if now and now != started:
        return
    if not signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + GRACE
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_group(pgid, signal.SIGKILL)


def _sweep(find: Callable[[], set[int]]) -> None:
    """SIGKILL what `find` names until it names nothing (a process may fork as it is killed), GRACE at most."""
    deadline = time.monotonic() + GRACE
    while (pids := find() - {os.getpid()}) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _end_cgroups(paths: list[str]) -> None:
    """SIGKILL every process in the worker's cgroups: v2's cgroup.kill where the kernel has it (5.14),
    else each pid its cgroup.procs lists."""
    for path in paths:
        with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")

    def members() -> set[int]:
        found: set[int] = set()
        for path in paths:
            with contextlib.suppress(OSError, ValueError), open(os.path.join(path, "cgroup.procs")) as f:
                found.update(int(line) for line in f.read().split())
        return found

    _sweep(members)


def _end_marked(markers: set[bytes]) -> None:
    """SIGKILL every process (of this user: others' environments are not readable) whose environment
    holds one of `markers`."""

    def marked() -> set[int]:
        found: set[int] = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                    if markers.intersection(f.read().split(b"\0")):
                        found.add(int(entry))
        return found

    if markers:
        _sweep(marked)


def _close_all_but(keep: int) -> None:
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd != keep:
            with contextlib.suppress(OSError):
                os.close(fd)
