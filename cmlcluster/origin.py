"""Which process a session is, told apart from every other one that could share its name or pid.

`cmlcluster list` and `cleanup` read where a session runs from its record (records.py), its
containers' labels or its Secret's annotations. A hostname and a pid say too little: a devcontainer
sharing the Docker socket and the hostname has a PID namespace of its own, two laptops of one name
may share a Kubernetes namespace, and a pid is reused once its process ends. So an origin also
holds the kernel's boot id and the PID namespace (both where the system has them: Linux), and the
process's start time. Only a session of this boot and PID namespace whose pid no longer runs the
process that started it is gone; and before what it left is deleted, its controller is asked too
(`state`): one that still answers means the session lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass

ALIVE = "alive"  # its process runs
GONE = "gone"  # its process is gone and its controller does not answer: what it left may be ended
ANSWERING = "answering"  # its process looks gone, but its controller answers: left alone
ELSEWHERE = "elsewhere"  # another machine, boot or PID namespace (or an origin too old to tell): left alone

PROBE_TIMEOUT = 1.0  # seconds for the controller to accept a connection


@dataclass(frozen=True)
class Origin:
    """Where a process runs. Strings, as labels and annotations carry them; "" where unknown."""

    host: str
    boot: str  # the kernel's boot id: pids and start times count from one boot of one kernel
    pidns: str  # the inode of the PID namespace: pids mean something only inside one
    pid: int
    start: str  # when the process started, in the kernel's clock ticks since boot (psutil's time elsewhere)

    def as_strings(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_strings(cls, values: Mapping[str, object]) -> Origin | None:
        """The origin written by as_strings; None when it lacks a host, a pid or a start time (an
        origin written before cmlcluster recorded those: nothing can be told about it)."""
        try:
            pid = int(str(values.get("pid", "")))
        except ValueError:
            return None
        host, start = str(values.get("host") or ""), str(values.get("start") or "")
        if not host or not start or pid <= 0:
            return None
        return cls(host, str(values.get("boot") or ""), str(values.get("pidns") or ""), pid, start)

    def here(self) -> bool:
        """Whether this origin is of this machine, boot and PID namespace: the only ones whose pids we can read."""
        mine = this_process()
        return (self.host, self.boot, self.pidns) == (mine.host, mine.boot, mine.pidns)


def this_process() -> Origin:
    """This process's origin."""
    pid = os.getpid()
    return Origin(socket.gethostname(), _boot_id(), _pid_namespace(), pid, start_time(pid))


def start_time(pid: int) -> str:
    """When process `pid` started, as a string that differs between two processes of one pid; ""
    when none runs. Linux: field 22 of /proc/<pid>/stat, clock ticks since boot (exact, unlike a
    wall-clock time derived from it, which moves when the boot time is adjusted)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses; starttime is field 22.
            return f.read().rpartition(")")[2].split()[19]
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return ""  # Linux, and no such process
    except (OSError, IndexError):
        return ""
    try:
        import psutil  # not Linux: ipyparallel depends on psutil
    except ImportError:
        return ""
    try:
        return f"{psutil.Process(pid).create_time():.3f}"
    except (psutil.Error, OSError):
        return ""


def state(origin: Origin | None, controller: str | None = None) -> str:
    """ALIVE, GONE, ANSWERING or ELSEWHERE (see above) for a session of `origin` whose controller
    listens at `controller` ("ip:port", when known)."""
    if origin is None or not origin.here():
        return ELSEWHERE
    if start_time(origin.pid) == origin.start:
        return ALIVE  # that pid still runs the process that started the session
    return ANSWERING if answers(controller) else GONE


def answers(address: str | None, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether something accepts a TCP connection at `address` ("ip:port", "[v6]:port")."""
    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def controller_address(connection_info: str) -> str:
    """ "ip:port" of the registration socket in a controller's engine connection info (the JSON that
    workers get); "" when it names none."""
    try:
        info = json.loads(connection_info)
        ip, port = str(info["location"]), int(info["registration"])
    except (ValueError, TypeError, KeyError):
        return ""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    return ""


def _pid_namespace() -> str:
    with contextlib.suppress(OSError):
        return str(os.stat("/proc/self/ns/pid").st_ino)
    return ""
