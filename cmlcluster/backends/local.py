"""Workers as local processes: the default, no Docker needed.

Each worker is a process in its own session (so the notebook's Ctrl-C does
not reach it and stopping it takes its whole process tree), with its output
copied into a capped log file (logfile.py), its own GPUs in CUDA_VISIBLE_DEVICES,
and CPU/memory limits through cgroups where the OS allows (said once where not).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import _lifeline, wire
from .._proc import end_group_async, signal_left_of_group
from ..agent.template import MAX_TEMPLATES, ForkedProcess, Template, can_fork, shared_environment
from ..cgroups import CgroupLimits
from ..errors import BackendError
from ..logfile import WorkerOutput, start_process
from ..resources import GpuPool, LimitsNotice, check_fits_machine, machine_cpus, machine_memory_gb, visible_gpus
from ..workers import Resources, WorkerSpec
from .base import OUTPUT_DRAIN_SECONDS, Backend, Capabilities, SessionContext, log_tail

log = logging.getLogger(__name__)

LOCAL_SILENCE_TIMEOUT = 10.0  # seconds: the default silence_timeout of workers on the session's host


@dataclass(eq=False)
class LocalHandle:
    process: asyncio.subprocess.Process | ForkedProcess
    output: WorkerOutput
    log_path: str
    gpus: list[str]
    limits: CgroupLimits | None
    released: bool = field(default=False)

    @property
    def pid(self) -> int:
        return self.process.pid


class LocalBackend(Backend[LocalHandle]):
    name = "local"

    def __init__(self, gpus: Sequence[str] | None = None, apply_limits: bool = True, fork: bool = True):
        """gpus: the GPU ids to hand out (default: the session's CUDA_VISIBLE_DEVICES, else nvidia-smi).
        fork: start workers from a template agent (agent/template.py); False starts each on its own."""
        self._gpus = GpuPool(list(gpus) if gpus is not None else visible_gpus())
        self._apply_limits = apply_limits
        self._fork = fork
        self._templates: dict[frozenset[tuple[str, str]], Template] = {}
        self._limits_notice = LimitsNotice()
        self._lifeline = (-1, -1)  # (read, write): a pipe while attached

    @property
    def gpus(self) -> GpuPool:
        return self._gpus

    def capabilities(self) -> Capabilities:
        # This machine, this user, this environment: workers inherit the session's variables. No
        # network lies between them and the session: a silence is a frozen or dead session, not a blip.
        return Capabilities(
            own_address=False,
            session_host=True,
            session_machine=True,
            python=sys.executable,
            shared_paths=("/",),
            stable_addresses=True,
            silence_timeout=LOCAL_SILENCE_TIMEOUT,
        )

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        self._limits_notice = LimitsNotice()  # said once per session
        # The session's lifeline (wire.LIFELINE_FD_ENV): every worker inherits the read end, and only this
        # process holds the write end (Python's descriptors are not inherited by what it starts), so the
        # workers of a killed kernel end at once instead of after silence_timeout.
        self._lifeline = os.pipe()
        _lifeline.guard(self._lifeline[1])  # nor does a child this process forks (multiprocessing)

    async def check(self, n: int, resources: Resources) -> None:
        # Each worker's cpu= and memory= against the whole machine: limits, not reservations, so workers
        # together may ask for more than it has (as CML's may of a node's spare capacity).
        check_fits_machine(resources, machine_cpus(), machine_memory_gb())
        self._gpus.check(n, resources)

    async def start(self, spec: WorkerSpec) -> LocalHandle:
        gpus = self._gpus.take(spec.resources.nvidia_gpu)
        env = dict(os.environ)
        env.update(spec.env)
        # Zero GPUs means none visible, not all of them.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        log_path = self.context.log_path(spec.worker_id)  # kept after the session
        own = os.path.join(self.context.session_dir, "workers", spec.worker_id)
        # The worker's temp files live in the session's folder, so none outlives the session
        # even when the worker is killed (a container's /tmp goes with the container the same way).
        env["TMPDIR"] = f"{own}.tmp"
        os.makedirs(env["TMPDIR"], exist_ok=True)
        lifeline = self._lifeline[0]
        env[wire.LIFELINE_FD_ENV] = str(lifeline)
        limits = (
            CgroupLimits(
                f"cmlcluster-{self.context.session_id}/{spec.worker_id}", spec.resources.cpu, spec.resources.memory
            )
            if self._apply_limits
            else None
        )
        template = self._template(spec, env)
        fifo = f"{own}.output"
        forked = await self._fork_from(template, env, spec.cwd, log_path, fifo) if template is not None else None
        try:
            process, output = forked or await start_process(
                log_path,
                *spec.argv,
                env=env,
                cwd=spec.cwd,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(lifeline,),
            )
        except OSError as e:
            self._gpus.give_back(gpus)
            if limits:
                limits.remove()
            raise BackendError(f"could not start worker {spec.worker_id} ({spec.argv[0]}): {e}") from e
        if limits:
            limits.add(process.pid)
            self._limits_notice.check(limits)
        return LocalHandle(process=process, output=output, log_path=log_path, gpus=gpus, limits=limits)

    async def _fork_from(
        self, template: Template, env: dict[str, str], cwd: str, log_path: str, fifo: str
    ) -> tuple[ForkedProcess, WorkerOutput] | None:
        """A worker forked by `template`, writing into a FIFO (at `fifo`, in the session's folder) that the
        session copies into its log; None when the template cannot fork it (then local workers start on
        their own from now on)."""
        try:
            output = WorkerOutput(log_path, fifo=fifo)
        except OSError as e:  # a folder without FIFOs
            log.warning("cmlcluster: cannot make %s (%s); local workers start on their own from now on", fifo, e)
            self._fork = False
            return None
        try:
            return await template.fork(env, cwd, fifo), output
        except BackendError as e:
            log.warning("cmlcluster: %s; local workers start on their own from now on", e)
            self._fork = False
            output.close()
            return None
        except BaseException:
            output.close()
            raise
        finally:
            output.handed_over()  # the worker holds its own end of the FIFO (or there is none)

    def _template(self, spec: WorkerSpec, env: dict[str, str]) -> Template | None:
        """The template that forks this worker, started on first use; None: start it on its own."""
        if not (self._fork and can_fork(spec, env)):
            return None
        shared = shared_environment(env)
        key = frozenset(shared.items())
        if key not in self._templates:
            if len(self._templates) >= MAX_TEMPLATES:
                return None
            log_path = os.path.join(self.context.session_dir, "workers", f"template-{len(self._templates)}.log")
            self._templates[key] = Template(shared, log_path, pass_fds=(self._lifeline[0],))
        return self._templates[key]

    async def close(self) -> None:
        templates, self._templates = list(self._templates.values()), {}
        await asyncio.gather(*(t.close() for t in templates))
        # Its workers are stopped by now (the session stops them first).
        for fd in self._lifeline:
            if fd >= 0:  # closed once
                os.close(fd)
        self._lifeline = (-1, -1)

    async def poll(self, handle: LocalHandle) -> int | None:
        return handle.process.returncode

    async def wait(self, handle: LocalHandle) -> int:
        code = await handle.process.wait()
        self._release(handle)  # its group is gone: nothing of it holds its output's pipe
        await handle.output.drain(OUTPUT_DRAIN_SECONDS)  # output() holds all it wrote
        return code

    def _release(self, handle: LocalHandle) -> None:
        if handle.released:
            return
        handle.released = True
        # The agent is gone (reaped); anything its program left in the group goes too.
        signal_left_of_group(handle.pid, signal.SIGKILL)
        self._gpus.give_back(handle.gpus)
        if handle.limits:
            handle.limits.remove()

    async def stop(self, handle: LocalHandle, grace: float = 5.0) -> None:
        await end_group_async(handle.process, grace)
        self._release(handle)
        await handle.output.drain(OUTPUT_DRAIN_SECONDS)

    def output(self, handle: LocalHandle) -> str:
        return log_tail(handle.log_path)
