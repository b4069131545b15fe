"""Process hygiene: how a helper process is started, and how a process group is ended, in one place.

python_module() is the argv of every helper the session starts as `python -m`: its controller, the
Docker reaper, TensorBoard, an elastic PyTorch run's store and horovodrun (the Horovod driver). None of
them may import from the working folder, the notebook's: a json.py or zmq.py there would run as the
session.

end_group() and end_group_async() are the sequence every part of cmlcluster ends a process
with: the local backend's workers, horovodrun, TensorBoard and an SSH host's worker. What
differs is a parameter: who gets the TERM (the group, only its leader, or also processes
that left the group), never a sequence of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Protocol

# The cmlcluster package this process imported (in a site-packages, or a checkout).
_PACKAGE = os.path.dirname(os.path.abspath(__file__))

# `python -m MODULE ARGS` without the working folder on sys.path, for Pythons without -P (3.10), and for
# cmlcluster's own modules. argv[1] is the folder of the cmlcluster package to run ("" for none): the one
# this process imported, which may be on its sys.path only as the working folder (a checkout, not
# installed), and which another cmlcluster installed in site-packages must not stand in for. It is
# imported from that folder alone, without the folder's parent on sys.path, where anything else could
# take a standard or installed module's place. `sys` is built in: nothing is imported before the working
# folder is off sys.path.
_RUN_MODULE = """\
import sys
if not getattr(sys.flags, "safe_path", 0):
    sys.path.pop(0)
package = sys.argv.pop(1)
if package:
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "cmlcluster", package + "/__init__.py", submodule_search_locations=[package]
    )
    sys.modules["cmlcluster"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["cmlcluster"])
import runpy
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def python_module(module: str, *args: str) -> list[str]:
    """The argv that runs `python -m module args` in this Python, the working folder NOT first on sys.path
    (as `python -m` puts it, so that a json.py in the notebook's folder would be imported in place of the
    standard one): `-P` on Python 3.11 and later; and through _RUN_MODULE for cmlcluster's own modules,
    which are this process's cmlcluster, and on 3.10, which has no -P."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    if module.split(".")[0] == "cmlcluster":
        return [sys.executable, *safe, "-c", _RUN_MODULE, _PACKAGE, module, *args]
    if safe:
        return [sys.executable, *safe, "-m", module, *args]
    return [sys.executable, "-c", _RUN_MODULE, "", module, *args]


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False if nothing is left in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_left_of_group(pgid: int, sig: int) -> bool:
    """Send `sig` to what is left of the process group whose leader `pgid` has been reaped (processes it
    started that stayed in its group); False if nothing was sent.

    Linux gives no new process a pid that still names a process group, so a live process with that pid
    now means the old group is empty and the pid someone else's: pids come round again once the counter
    wraps (within minutes on a busy machine with the default pid_max of 32,768), and a group signal sent
    then would reach whatever leads a group of that number now (a user's process, another session's
    worker). Nothing is sent then."""
    if alive(pgid):
        return False
    return signal_group(pgid, sig)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), whatever its session or group: an sshd's logins start
    sessions of their own, so they escape a signal to their parent's group."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def group_members(pgid: int) -> list[int]:
    """The processes of a process group that have not exited (Linux /proc; zombies are left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, _ppid, group = f.read().rpartition(")")[2].split()[:3]
            except (OSError, ValueError):
                continue
            if int(group) == pgid and state != "Z":
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether a process of this id runs on this machine (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exited(pid: int) -> bool:
    """Whether a child of this process has exited, without reaping it: while its pid is unreaped, the
    group it led cannot be reused, so a KILL to that group reaches only what is left of it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped
        return True


def end_group(
    process: subprocess.Popen[bytes] | subprocess.Popen[str],
    grace: float,
    *,
    leader_only: bool = False,
    others: Callable[[], Iterable[int]] = tuple,
    reap: bool = True,
) -> int | None:
    """End the process group `process` leads: TERM (to its leader only, with leader_only; also to each
    of others(), processes that left the group), KILL the group and others() once the leader exited
    or after `grace` s, reap the leader (not with reap=False: in a signal handler that may have
    interrupted the process's own wait(), which holds the lock a second wait() needs). Its exit code."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.returncode is not None:  # reaped (perhaps long ago): its pid may be someone else's now
            signal_left_of_group(process.pid, sig)
        elif sig == signal.SIGTERM and leader_only:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)
        else:
            signal_group(process.pid, sig)
        for pid in others():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and not exited(process.pid):
                time.sleep(0.05)
    return process.wait() if reap else None


class AsyncProcess(Protocol):
    """An asyncio subprocess, or a worker forked from a template (agent_template.ForkedProcess)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


async def end_group_async(process: AsyncProcess, grace: float) -> int:
    """end_group() for a process asyncio started (asyncio reaps it, so what is left of its group gets
    the KILL at once after it exits). Its exit code. Idempotent: for a process that ended long ago (a
    session closing a worker that finished) nothing reaches a group that took its number since."""
    import asyncio  # here: an SSH host's relay imports this module, and never this (20 ms of its start)

    if process.returncode is None and signal_group(process.pid, signal.SIGTERM):
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), grace)
    if process.returncode is None:
        signal_group(process.pid, signal.SIGKILL)  # itself after the grace: alive, so its pid is its own
    signal_left_of_group(process.pid, signal.SIGKILL)  # what it left in its group
    return await process.wait()
