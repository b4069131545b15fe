"""GPUs and CPU/memory limits for workers that run as local processes."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping

from .errors import ConfigError
from .workers import Resources

log = logging.getLogger(__name__)


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this session may hand out: its own CUDA_VISIBLE_DEVICES if set, else all nvidia-smi lists."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        ids = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        # CUDA stops at the first invalid id; "-1" is the usual way to say "none".
        valid: list[str] = []
        for d in ids:
            if d.startswith("-"):
                break
            valid.append(d)
        return valid
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError) as e:
        log.warning("nvidia-smi failed (%s); assuming no GPUs", e)
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


class GpuPool:
    """Hands each worker its own GPUs, and takes them back when it ends."""

    def __init__(self, gpus: list[str]):
        self.all = list(gpus)
        self._free = list(gpus)

    @property
    def free(self) -> list[str]:
        return list(self._free)

    def check(self, n: int, resources: Resources) -> None:
        """Refuse a launch that asks for more GPUs than are free, before anything starts."""
        wanted = n * resources.nvidia_gpu
        if wanted > len(self._free):
            have = ", ".join(self.all) or "none"
            raise ConfigError(
                f"nvidia_gpu={resources.nvidia_gpu} for {n} workers needs {wanted} GPUs, but this machine has "
                f"{len(self.all)} (ids: {have}) of which {len(self._free)} are free; "
                "ask for fewer GPUs or workers, or stop workers that hold GPUs"
            )

    def take(self, k: int) -> list[str]:
        if k > len(self._free):
            raise RuntimeError(f"asked for {k} GPUs, {len(self._free)} free")
        taken, self._free = self._free[:k], self._free[k:]
        return taken

    def give_back(self, gpus: list[str]) -> None:
        self._free.extend(g for g in gpus if g not in self._free)
        self._free.sort(key=self.all.index)


CGROUP_ROOT = "/sys/fs/cgroup"
CPU_PERIOD_US = 100_000


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


class LimitsNotice:
    """Says once (a LocalBackend makes one per session), at WARNING, that local workers run without
    their CPU/memory limits: why, and what to do. Limits are best effort; a silent miss is not."""

    def __init__(self) -> None:
        self.said = False

    def check(self, limits: CgroupLimits) -> None:
        if limits.problem is None or self.said:
            return
        self.said = True
        log.warning(
            "cmlcluster: CPU/memory limits are not applied to local workers here (their cpu= and memory= are "
            "recorded only): %s. To have them applied, run the notebook where it may create cgroups below its "
            "own (as root, or under `systemd-run --user --scope -p Delegate=yes`), or use the docker backend; "
            "use_backend('local', apply_limits=False) asks for none, and silences this",
            limits.problem,
        )
