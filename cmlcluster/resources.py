"""GPUs for workers that run as local processes, the machine's size their cpu= and memory= must fit, and the
notice that their CPU/memory limits are not applied (the limits themselves: cgroups.py)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .errors import ConfigError
from .workers import Resources

if TYPE_CHECKING:
    from .cgroups import CgroupLimits

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


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset), else all the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_memory_gb() -> float | None:
    """The machine's memory in GB (2**30 bytes, as memory= counts), None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_machine(
    resources: Resources, cpus: int, memory_gb: float | None, machine: str = "this machine", workers: str = "local"
) -> None:
    """Refuse a worker that asks for more CPUs or memory than the machine its workers share has (`machine`,
    in words; `workers`, what they are): none could ever have them, and a limit above the machine is no
    limit. Before anything starts."""
    if resources.cpu > cpus:
        raise ConfigError(
            f"cpu={resources.cpu:g}: {machine} has {cpus} CPU{'s' * (cpus != 1)} for {workers} workers; "
            f"ask for at most cpu={cpus}, or use a backend whose workers run elsewhere (ssh, kubernetes)"
        )
    if memory_gb is not None and resources.memory > memory_gb:
        raise ConfigError(
            f"memory={resources.memory:g}: {machine} has {memory_gb:.1f} GB of memory in all; ask for at "
            "most that much (memory= is in GB), or use a backend whose workers run elsewhere (ssh, kubernetes)"
        )


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
