"""CPU and memory limits for a worker's processes, through cgroups, where this process may make them; and
the memory limit a process is under (memory_limit: what a worker's agent reports beside its use, usage.py).

Imported by the local backend in the session and by each SSH worker's relay on its host (ssh_remote):
only the standard library's os, so that it adds nothing to a worker's start there."""

from __future__ import annotations

import os

CGROUP_ROOT = "/sys/fs/cgroup"
CPU_PERIOD_US = 100_000
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (9223372036854771712); anything this
# large is no limit a machine could reach.
UNLIMITED_FROM = 1 << 60


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of `controller` (or v2 when controller is "")."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers.split(",") == [controller] or (controller == "" and controllers == ""):
                    return path
    except OSError:
        pass
    return None


class CgroupLimits:
    """CPU quota and memory limit for one worker, through cgroups v2 or v1, when writable.

    Best effort by design: a laptop or an unprivileged container cannot create
    cgroups, and the worker then runs with its resources recorded only.
    """

    def __init__(self, name: str, cpu: float, memory_gb: float):
        self.paths: list[str] = []
        self.applied: dict[str, str] = {}
        self.problem: str | None = None  # why the limits are not (all) applied, for LimitsNotice
        memory_bytes = str(int(memory_gb * 1024**3))
        quota = str(max(1000, int(cpu * CPU_PERIOD_US)))
        if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
            own = _own_cgroup("")
            if own is not None:
                self._make(
                    os.path.join(CGROUP_ROOT, own.lstrip("/"), name),
                    {"memory.max": memory_bytes, "cpu.max": f"{quota} {CPU_PERIOD_US}"},
                )
        else:
            for controller, settings in (
                ("memory", {"memory.limit_in_bytes": memory_bytes}),
                ("cpu", {"cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu.cfs_quota_us": quota}),
            ):
                own = _own_cgroup(controller)
                if own is not None:
                    self._make(os.path.join(CGROUP_ROOT, controller, own.lstrip("/"), name), settings)
        if not self.paths and self.problem is None:
            self.problem = "this process is in no cgroup that it can see (/proc/self/cgroup)"

    def _make(self, path: str, settings: dict[str, str]) -> None:
        try:
            os.makedirs(path, exist_ok=True)
            self.paths.append(path)
            for key, value in settings.items():
                with open(os.path.join(path, key), "w") as f:
                    f.write(value)
                self.applied[key] = value
        except OSError as e:
            self.problem = self.problem or f"cannot write {e.filename or path}: {e.strerror or e}"

    def add(self, pid: int) -> None:
        for path in self.paths:
            try:
                with open(os.path.join(path, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                pass  # it has exited already: nothing to limit
            except OSError as e:
                self.problem = self.problem or f"cannot move a worker into {path}: {e.strerror or e}"

    def remove(self) -> None:
        for path in reversed(self.paths):
            # The leaf, then the session folder once it is empty.
            for folder in (path, os.path.dirname(path)):
                try:
                    os.rmdir(folder)
                except OSError:
                    break
        self.paths = []


def memory_limit(root: str = CGROUP_ROOT) -> int | None:
    """The bytes of memory this process may use under its cgroups: the lowest limit set on its cgroup or on
    any above it (cgroup v2's memory.max, v1's memory.limit_in_bytes; an ancestor's binds too). None when
    none is set or none can be read (no cgroups: macOS; a limit nothing enforces is not one).

    A container sees its own cgroup at the root of its mount while /proc/self/cgroup may name the host's
    path (cgroup v1, or v2 without a cgroup namespace): the walk up from that path ends at the mount's
    root, so the container's limit is read there.
    """
    found: list[int] = []
    for controller, name in (("", "memory.max"), ("memory", "memory.limit_in_bytes")):
        own = _own_cgroup(controller)
        if own is None:
            continue
        base = os.path.join(root, controller) if controller else root
        path = "/" + own.strip("/")
        while True:
            value = _read_limit(os.path.join(base, path.lstrip("/"), name))
            if value is not None:
                found.append(value)
            if path == "/":
                break
            path = os.path.dirname(path)
    return min(found) if found else None


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # v2's "max": no limit here
    value = int(text)
    return value if value < UNLIMITED_FROM else None
