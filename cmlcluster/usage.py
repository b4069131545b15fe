"""What a worker uses now: its process tree's CPU and memory, its memory limit, and its GPUs.

Each worker's agent runs one Sampler thread (agent_engine starts it once its engine has registered):
every wire.DEFAULT_USAGE_SECONDS (the worker's CMLCLUSTER_USAGE_SECONDS; 0 turns it off) it measures

- the CPU the agent and all its descendants used over the period, in % of one core (psutil: their
  user + system time, with that of the children they reaped, so a process that ends between two
  samples still counts), and their resident memory, summed (pages two processes share count twice);
- the memory limit the worker runs under: its cgroup's (cgroups.memory_limit), None where nothing
  enforces one. Not the memory it asked for: that is in its dict already ("memory", GB), and a limit
  that nothing enforces would tell a worker it is safe at 90 % of it when the machine is what stops it;
- its GPUs, through NVML (nvidia-ml-py's pynvml), only where it was given GPUs (CUDA_VISIBLE_DEVICES,
  or a container runtime's NVIDIA_VISIBLE_DEVICES) and pynvml imports: each one's utilization and
  memory, by its index on the host.

A sample travels as one message on the engine's iopub channel, of its own type and topic
(wire.USAGE_MSG_TYPE, wire.USAGE_TOPIC), with no parent request: ipyparallel's client and hub pass such
messages by, and the session's control plane takes them off the client's iopub stream
(ipyparallel_internals.route_iopub_topic). Nothing of it is a line of output: a marked line like
progress.report's would land in the worker's kept log (the engine echoes its output there) and reach the
session only while a request runs; an apply request per sample would wait behind the running program.

psutil is imported in the sampler's thread, after a first wait, never on the agent's start path (the
local backend's template imports it once for all its workers). Where it is missing, or anything in the
sampler fails, sampling stops with one line in the worker's log; the worker runs on.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import cgroups, wire
from .errors import install_hint
from .events import GpuUse, ResourceUse

Send = Callable[[dict[str, Any]], None]
Say = Callable[[str], None]


def period(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between samples: CMLCLUSTER_USAGE_SECONDS, else wire.DEFAULT_USAGE_SECONDS; 0 is off (also
    for a value that is not a number of seconds: sampling is never worth a worker that fails to start)."""
    text = environ.get(wire.USAGE_SECONDS_ENV)
    if text is None:
        return wire.DEFAULT_USAGE_SECONDS
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if 0 < value < math.inf else 0.0


# ---------------------------------------------------------------- the process tree


class ProcessTree:
    """A process and all its descendants: the CPU seconds they have used, and their resident memory.

    Finding descendants means knowing every process's parent: psutil's children(recursive=True) reads
    every process's stat at each call (64 agents, each every 2 s, on a machine of hundreds of processes).
    This keeps each pid's parent from the sample it appeared in, and reads only new pids' and the tree's.
    """

    def __init__(self, psutil: Any, root: int):
        self._psutil = psutil
        self.root = root
        self._parents: dict[int, int] = {}  # pid -> parent pid, every process seen still running
        self._processes: dict[int, Any] = {}  # the tree's psutil.Process objects, kept between samples

    def members(self) -> list[int]:
        """The root's pid and its descendants' (the root first)."""
        running = set(self._psutil.pids())
        for pid in self._parents.keys() - running:
            del self._parents[pid]
        for pid in running - self._parents.keys():
            parent = _parent_of(self._psutil, pid)
            if parent is not None:
                self._parents[pid] = parent
        children: dict[int, list[int]] = {}
        for pid, parent in self._parents.items():
            children.setdefault(parent, []).append(pid)
        found, todo, seen = [], [self.root], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue  # pid 0's parent is itself on some systems
            seen.add(pid)
            found.append(pid)
            todo.extend(children.get(pid, ()))
        return found

    def measure(self) -> tuple[float, int]:
        """(CPU seconds the tree has used, including what its processes' reaped children used; bytes
        resident). A child that ended and was reaped by a member moved its time into the member's
        children's counters: the tree's total does not drop when a process ends."""
        psutil = self._psutil
        cpu, resident = 0.0, 0
        kept: dict[int, Any] = {}
        for pid in self.members():
            process = self._processes.get(pid)
            try:
                if process is None:
                    process = psutil.Process(pid)
                with process.oneshot():
                    times = process.cpu_times()  # a zombie's still reads: its time is not lost before its reaping
                    self._parents[pid] = process.ppid()  # a member whose parent ended was taken in by another
                    try:
                        resident += process.memory_info().rss
                    except psutil.Error:
                        pass  # a zombie: nothing resident
            except psutil.Error:
                continue  # it ended meanwhile
            cpu += (
                times.user
                + times.system
                + getattr(times, "children_user", 0.0)
                + getattr(times, "children_system", 0.0)
            )
            kept[pid] = process
        self._processes = kept
        return cpu, resident


def _parent_of(psutil: Any, pid: int) -> int | None:
    """A process's parent pid: one read of /proc/<pid>/stat where there is /proc, else psutil's."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # it ended
    except (OSError, ValueError, IndexError):
        return None
    try:
        parent: int = psutil.Process(pid).ppid()
        return parent
    except psutil.Error:
        return None


# ---------------------------------------------------------------- GPUs


def given_gpus(environ: Mapping[str, str] = os.environ) -> tuple[str, list[str]] | None:
    """Which GPUs the worker was given, as ("cuda", ids) or ("runtime", ids); None for none.

    CUDA_VISIBLE_DEVICES, where set, decides (empty: none; the local and SSH backends set it to the
    host's indices, or UUIDs); as CUDA does, the list ends at the first entry that names no device.
    Else a container runtime's NVIDIA_VISIBLE_DEVICES ("all", indices or UUIDs): NVML in the container
    sees those devices and no other. CUDA images set "all" for every container, GPUs or not:
    Gpus.open says nothing when that finds no GPU.
    """
    cuda = environ.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None:
        ids = []
        for entry in (e.strip() for e in cuda.split(",")):
            if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
                break
            ids.append(entry)
        return ("cuda", ids) if ids else None
    runtime = environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if runtime in ("", "void", "none"):
        return None
    return ("runtime", [e.strip() for e in runtime.split(",") if e.strip()])


class Gpus:
    """The worker's GPUs through NVML: each one's utilization and memory, by its index on the host."""

    def __init__(self, nvml: Any, devices: list[tuple[int, Any]]):
        self._nvml = nvml
        self.devices = devices  # (index on the host, NVML handle)

    @classmethod
    def open(cls, environ: Mapping[str, str], say: Say) -> Gpus | None:
        """The worker's GPUs, or None (said once, where the worker was given GPUs that cannot be read)."""
        given = given_gpus(environ)
        if given is None:
            return None
        how, ids = given
        quiet = how == "runtime" and ids == ["all"]  # a CUDA image's default, also in containers without GPUs
        try:
            import pynvml
        except ImportError:
            if not quiet:
                say(f"its GPUs are not sampled: pynvml is missing; {install_hint('gpu', 'nvidia-ml-py')}")
            return None
        try:
            pynvml.nvmlInit()
            devices = _cuda_devices(pynvml, ids) if how == "cuda" else _runtime_devices(pynvml, ids)
        except pynvml.NVMLError as e:
            if not quiet:
                say(f"its GPUs are not sampled: NVML: {e}")
            return None
        return cls(pynvml, devices) if devices else None

    def read(self) -> list[GpuUse]:
        """Each GPU now; one NVML cannot read is left out of this sample."""
        nvml = self._nvml
        found = []
        for index, handle in self.devices:
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError:
                continue
            try:
                busy = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError:
                busy = math.nan  # a MIG slice has none
            found.append(GpuUse(index, busy, int(memory.used), int(memory.total)))
        return found


def _cuda_devices(nvml: Any, ids: list[str]) -> list[tuple[int, Any]]:
    """CUDA_VISIBLE_DEVICES' entries as NVML's devices: an index is NVML's (nvidia-smi's, from which the
    backends hand GPUs out), a UUID is looked up."""
    devices = []
    for entry in ids:
        if entry.isdigit():
            devices.append((int(entry), nvml.nvmlDeviceGetHandleByIndex(int(entry))))
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(entry)
            devices.append((_index_of(nvml, handle), handle))
    return devices


def _runtime_devices(nvml: Any, ids: list[str]) -> list[tuple[int, Any]]:
    """The devices a container runtime gave (NVML in the container sees those only, numbered from 0), by
    their host index where NVIDIA_VISIBLE_DEVICES gives one per device: NVML numbers devices in the order
    of their PCI addresses, on the host as in the container."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    if all(e.isdigit() for e in ids) and len(ids) == len(handles):
        return list(zip(sorted(int(e) for e in ids), handles, strict=True))
    return [(_index_of(nvml, h), h) for h in handles]


def _index_of(nvml: Any, handle: Any) -> int:
    try:
        return int(nvml.nvmlDeviceGetIndex(handle))
    except nvml.NVMLError:
        try:  # a MIG device: its GPU's index
            return int(nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)))
        except (nvml.NVMLError, AttributeError):
            return -1


# ---------------------------------------------------------------- the sampler


class Sampler:
    """One worker's samples, every `seconds`, handed to `send` as a message's content (encode)."""

    def __init__(
        self, seconds: float, send: Send, say: Say, root: int | None = None, environ: Mapping[str, str] = os.environ
    ):
        self.seconds = seconds
        self._send = send
        self._say = say
        self._root = os.getpid() if root is None else root
        self._environ = environ
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self.thread = threading.Thread(target=self.run, name="cmlcluster-usage", daemon=True)
        self.thread.start()
        return self

    def stop(self, join_seconds: float = 0.0) -> None:
        """End its thread, waiting up to `join_seconds` for it to end (a send in progress finishes)."""
        self._stop.set()
        if join_seconds and self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(join_seconds)

    def run(self) -> None:
        # Workers launched together would sample together: each starts at its own point of the period,
        # after its start's busiest moment (psutil's import is not on its path to running).
        if self._stop.wait(self.seconds * random.uniform(0.2, 1.0)):  # noqa: S311 - spreading, not secrecy
            return
        try:
            import psutil
        except ImportError:
            self._say("its CPU and memory are not sampled: psutil is missing (pip install psutil)")
            return
        try:
            tree = ProcessTree(psutil, self._root)
            gpus = Gpus.open(self._environ, self._say)
            cpu, at = tree.measure()[0], time.monotonic()
            while not self._stop.wait(self.seconds):
                used, resident = tree.measure()
                now = time.monotonic()
                percent = max(0.0, 100 * (used - cpu) / (now - at)) if now > at else 0.0
                cpu, at = used, now
                self._send(encode(percent, resident, cgroups.memory_limit(), gpus.read() if gpus is not None else []))
        except Exception as e:  # a sample is never worth the worker
            self._say(f"its resource use is no longer sampled: {type(e).__name__}: {e}")


def start(send: Send, say: Say, environ: Mapping[str, str] = os.environ) -> Sampler | None:
    """The agent's sampler, started (None when CMLCLUSTER_USAGE_SECONDS turns it off)."""
    seconds = period(environ)
    return Sampler(seconds, send, say, environ=environ).start() if seconds > 0 else None


# ---------------------------------------------------------------- on the wire


def encode(cpu_percent: float, memory_bytes: int, memory_limit_bytes: int | None, gpus: list[GpuUse]) -> dict[str, Any]:
    """A sample as a message's content: JSON, no NaN (Jupyter's packer refuses it; an unknown is None)."""
    return {
        "cpu_percent": round(cpu_percent, 2),
        "memory_bytes": memory_bytes,
        "memory_limit_bytes": memory_limit_bytes,
        "gpus": [
            [
                g.index,
                None if math.isnan(g.utilization_percent) else g.utilization_percent,
                g.memory_bytes,
                g.memory_total_bytes,
            ]
            for g in gpus
        ],
    }


def decode(worker_id: str, content: Mapping[str, Any]) -> ResourceUse | None:
    """The ResourceUse in a sample's content, or None when it is not one (another version's, say)."""
    try:
        limit = content.get("memory_limit_bytes")
        return ResourceUse(
            worker_id=worker_id,
            cpu_percent=float(content["cpu_percent"]),
            memory_bytes=int(content["memory_bytes"]),
            memory_limit_bytes=None if limit is None else int(limit),
            gpus=tuple(
                GpuUse(int(index), math.nan if busy is None else float(busy), int(used), int(total))
                for index, busy, used, total in content.get("gpus") or ()
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
