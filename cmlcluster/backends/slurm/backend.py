"""Workers as Slurm jobs: Slurm places them, with the cores, memory and GPUs each asks for.

    cdsw.use_backend("slurm", partition="gpu", account="proj42", time_limit="2:00:00")

This machine is a Slurm submit host (a login node, or a machine whose ``slurm.conf`` names the cluster's
controller and whose munge key is the cluster's). Each worker is one ``srun`` here: a job of one task on
one node, running the worker's agent under the task launcher (task.py), which dials home to the session as
on every backend. One lifeline for the session's jobs cancels them all should this process die. Where the
notebook runs inside an allocation (started by sbatch, batchspawner or Open OnDemand: SLURM_JOB_ID), each
worker is a step of that allocation instead (srun --jobid --overlap). srun copies the worker's output back
here; the session never needs sshd on the nodes or a file system they share with it (scripts and folders
travel over the control plane, collect= comes home through the worker's agent).

What the session shows is Slurm's truth: a worker waits as "scheduling" with Slurm's reason and the jobs
ahead of it (one squeue for the whole session every POLL_SECONDS, queue.py), in the views, list_workers
and await_workers' failures when its time is up; a job cancelled outside cmlcluster ends as "stopped", a
time limit or a node's failure as "failed" with Slurm's words. Every job is named
``cmlcluster-<session>-<worker>`` and carries the session's mark in its comment: stopping a worker,
closing the session and ``cmlcluster cleanup`` cancel exactly those jobs, never by user or pattern alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ... import _lifeline
from ..._proc import signal_group
from ...errors import BackendError, ConfigError
from ...logfile import WorkerOutput
from ...ports import route_address
from ...workers import Resources, Status, WorkerSpec
from ..base import OUTPUT_DRAIN_SECONDS, Backend, Capabilities, SessionContext, log_tail, signal_exit_code
from . import commands, task
from .queue import JobQueue, slurm_command

log = logging.getLogger(__name__)

STOP_WAIT = 10.0  # seconds for srun to end once its job was cancelled
# What the worker keeps of this process's environment: how to run programs, never the notebook's variables.
PASSED_VARIABLES = ("PATH", "LANG", "LC_ALL", "HOME", "USER", "LOGNAME")
INSTALL_HINT = "apt-get install slurm-client (Debian; the same Slurm version as the cluster's), with munge"


@dataclass(eq=False)
class SlurmHandle:
    worker_id: str
    job_name: str
    process: asyncio.subprocess.Process
    output: WorkerOutput
    log_path: str


class SlurmBackend(Backend[SlurmHandle]):
    """Options:

    partition, account, qos: Slurm's own, for every job (the cluster's defaults where not given).
    time_limit: each job's --time: minutes (30), "2:00:00" or "1-00:00:00"; default: the partition's.
    signal_before_end: seconds before the time limit when each worker's program is sent SIGUSR1, to
        checkpoint (srun's --signal); 0: none.
    gpus: "gres" (--gres=gpu:N, the default) or "gpus-per-node" (--gpus-per-node=N), as the site asks.
    extra: more srun options, each "--name=value" (--constraint=a100, --reservation=course).
    python: the interpreter on the nodes, with cmlcluster installed (default: this one's path, as on
        sites whose software is on a file system every node mounts).
    slurm_conf: the slurm.conf to use (SLURM_CONF); default: Slurm's own search (SLURM_CONF, /etc/slurm).
    controller_ip: the session's address as the nodes reach it (default: this machine's address on its
        route to slurmctld).
    shared_paths: folders of this machine that every node sees at the same path (a shared home, say):
        nothing under them is shipped. Default: none.
    within_allocation: each worker a step of the Slurm allocation this process runs in (srun --jobid
        --overlap), as for a notebook that sbatch, batchspawner or Open OnDemand started; False: jobs of
        their own. Default: inside one when this process has SLURM_JOB_ID.
    """

    name = "slurm"

    def __init__(
        self,
        *,
        partition: str = "",
        account: str = "",
        qos: str = "",
        time_limit: str | int = "",
        signal_before_end: int = 0,
        gpus: str = "gres",
        extra: Sequence[str] = (),
        python: str = sys.executable,
        slurm_conf: str | None = None,
        controller_ip: str | None = None,
        shared_paths: Sequence[str] = (),
        within_allocation: bool | None = None,
    ):
        self.options = commands.job_options(partition, account, qos, time_limit, signal_before_end, gpus, extra)
        self.allocation = _allocation(within_allocation, self.options)
        if not isinstance(python, str) or not python:
            raise ConfigError(f"python={python!r}: give the interpreter's path on the nodes")
        if slurm_conf is not None and not os.path.isfile(os.path.expanduser(slurm_conf)):
            raise ConfigError(f"slurm_conf={slurm_conf!r}: no such file; give the path of the cluster's slurm.conf")
        if isinstance(shared_paths, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in shared_paths):
            raise ConfigError(f"shared_paths={shared_paths!r}: give a list of absolute folders every node sees")
        self.python = python
        # Slurm's commands run with this environment: the allocation given explicitly (--jobid) where they need
        # it, never through the variables the notebook's job set (SLURM_NTASKS, SLURM_MEM_PER_NODE, ... would
        # be a step's defaults).
        self.slurm_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        if slurm_conf is not None:
            self.slurm_env["SLURM_CONF"] = os.path.abspath(os.path.expanduser(slurm_conf))
        self.shared_paths = tuple(shared_paths)
        self._controller_ip = controller_ip
        self._queue: JobQueue | None = None
        self._handles: dict[str, SlurmHandle] = {}
        # Submit mode: the session's jobs' lifeline. A plain process, not an asyncio one: it lives as long as
        # the backend is attached, and no event loop of the caller's need outlive it.
        self._canceller: subprocess.Popen[bytes] | None = None

    def capabilities(self) -> Capabilities:
        # Workers share their node's address; the session's disk is not theirs, unless the site shares it.
        return Capabilities(own_address=False, session_host=False, python=self.python, shared_paths=self.shared_paths)

    def controller_ip(self) -> str:
        if self._controller_ip is None:
            config = self._run("scontrol", "show", "config")
            self._controller_ip = route_address(commands.controller_host(config))
        return self._controller_ip

    # ---------------------------------------------------------------- before anything starts

    async def check(self, n: int, resources: Resources) -> None:
        sinfo = ["sinfo", "-h", "-N", "-o", commands.SINFO_FORMAT]
        if self.allocation:  # its own nodes
            names = await asyncio.to_thread(self._run, "squeue", "-h", "-j", self.allocation, "-o", "%N")
            sinfo += ["-n", names.strip()]
        nodes = commands.parse_sinfo(await asyncio.to_thread(self._run, *sinfo))
        commands.check_fits(resources, nodes, self.options.partition)

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        for tool in ("srun", "squeue", "scancel", "sinfo", "scontrol"):
            if shutil.which(tool, path=self.slurm_env.get("PATH")) is None:
                raise ConfigError(f"the slurm backend needs Slurm's {tool} on this machine's PATH: {INSTALL_HINT}")
        await asyncio.to_thread(self._run, "squeue", "-h", "--me", "-o", "%i")  # reaches the controller, or says why
        self._queue = JobQueue(self.slurm_env, self.allocation)
        self._queue.start()
        if not self.allocation:
            # Should this process die (a killed kernel), its jobs end at once, not at the agents' silence
            # timeout: a lifeline (its own session, so that the notebook's Ctrl-C is not for it) that is told
            # each job's name and scancels them all once its input closes. One for the session, not a Python
            # process per worker beside its srun (bench/slurm_launch.py).
            cancel = ["scancel", "--me", "--full"]
            self._canceller = subprocess.Popen(
                [sys.executable, _lifeline.__file__, "--for-each-line", json.dumps(cancel)],
                env=self.slurm_env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def _run(self, *argv: str) -> str:
        return slurm_command(list(argv), self.slurm_env)

    # ---------------------------------------------------------------- the contract

    async def start(self, spec: WorkerSpec) -> SlurmHandle:
        assert self._queue is not None, "attach() first"
        name = commands.job_name(self.context.session_id, spec.worker_id)
        comment = commands.job_comment(self.context.session_id, socket.gethostname(), os.getpid())
        worker = [self.python, *spec.argv[1:]]
        if self.allocation:
            # Under a lifeline of its own: should this process die, srun is sent TERM, which cancels its step
            # (srun killed outright would leave the step running until the agent's silence timeout).
            srun = commands.step_argv("srun", self.allocation, name, spec.resources, self.options, self.python, worker)
            argv = [sys.executable, _lifeline.__file__, "--term-first", str(STOP_WAIT), "--", *srun]
            stdin = asyncio.subprocess.PIPE  # the lifeline's: this process holds its only writing end
        else:
            argv = commands.srun_argv("srun", name, comment, spec.resources, self.options, self.python, worker)
            assert self._canceller is not None and self._canceller.stdin is not None, "attach() first"
            try:
                self._canceller.stdin.write(f"--name={name}\n".encode())  # before the job exists
                self._canceller.stdin.flush()
            except OSError as e:  # it was killed: the job runs all the same, without it
                log.warning("cmlcluster: the session's Slurm lifeline is gone (%s): should this process die, "
                            "job %s runs until its agent's silence_timeout", e, name)  # fmt: skip
            stdin = asyncio.subprocess.DEVNULL  # srun would pass it to the worker
        env = {k: self.slurm_env[k] for k in (*PASSED_VARIABLES, "SLURM_CONF") if k in self.slurm_env}
        env.update(spec.env)
        env[task.GPUS_ENV] = str(spec.resources.nvidia_gpu)
        log_path = self.context.log_path(spec.worker_id)
        output = WorkerOutput(log_path)  # the worker's own output: the step's stdout
        try:
            # srun's own messages ("srun: error: ... task 0: Killed", slurmstepd's "*** STEP CANCELLED ***")
            # go beside the worker's log, not into it: what a worker printed last stays its own last line.
            with open(log_path + ".srun", "ab") as messages:
                process = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=self.context.session_dir, stdin=stdin,
                    stdout=output.write_fd, stderr=messages, start_new_session=True,
                )  # fmt: skip
        except OSError as e:
            output.close()
            raise BackendError(f"could not start srun for worker {spec.worker_id}: {e}") from e
        finally:
            output.handed_over()
        handle = SlurmHandle(spec.worker_id, name, process, output, log_path)
        self._handles[spec.worker_id] = handle
        self._queue.watch(name)
        return handle

    async def poll(self, handle: SlurmHandle) -> int | None:
        code = handle.process.returncode
        return None if code is None else signal_exit_code(code)

    async def wait(self, handle: SlurmHandle) -> int:
        code = await handle.process.wait()
        await handle.output.drain(OUTPUT_DRAIN_SECONDS)
        if self._queue is not None:
            await asyncio.to_thread(self._queue.settle, handle.job_name)  # its job's last state, for exit_reason
        return signal_exit_code(code)  # srun says a task killed by signal N exited 128+N

    async def stop(self, handle: SlurmHandle, grace: float = 5.0) -> None:
        process = handle.process
        if process.returncode is None and await asyncio.to_thread(self._signal_running, handle.job_name):
            # TERM to the worker's processes, its job or step left to end with them: the worker's cleanup runs
            # and its last lines reach srun. (srun itself, sent TERM, cancels the step: its tasks are killed.)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), grace)
        if process.returncode is None:  # still queued, or it did not end: its job or step is cancelled
            if self.allocation:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)  # its lifeline passes it to srun, which cancels its step
            else:
                await asyncio.to_thread(self._cancel, [handle.job_name])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), STOP_WAIT)
        if process.returncode is None:
            signal_group(process.pid, signal.SIGKILL)  # srun (and its lifeline, in an allocation)
        await process.wait()
        await handle.output.drain(OUTPUT_DRAIN_SECONDS)

    def output(self, handle: SlurmHandle) -> str:
        return log_tail(handle.log_path)

    def exit_reason(self, handle: SlurmHandle) -> str | None:
        job = self._queue.last(handle.job_name) if self._queue is not None else None
        if job is None or job.state not in commands.ENDED_AS:
            return None
        reason = f", {job.reason}" if job.reason and job.reason != "None" else ""
        return f"Slurm ended its job {job.job_id}: {job.state}{reason}"

    def exit_status(self, handle: SlurmHandle) -> Status | None:
        job = self._queue.last(handle.job_name) if self._queue is not None else None
        return commands.ENDED_AS.get(job.state) if job is not None else None

    def waiting_reason(self, handle: SlurmHandle) -> str | None:
        return self._queue.waiting_reason(handle.job_name) if self._queue is not None else None

    async def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        left = [h.job_name for h in self._handles.values() if h.process.returncode is None]
        if left:  # the session stopped every worker; this is for one whose stop failed
            await asyncio.to_thread(self._cancel, left)
        self._handles = {}
        if self._canceller is not None:  # nothing is left for it to cancel: it goes without a word
            self._canceller.kill()
            self._canceller.wait()
            if self._canceller.stdin is not None:
                self._canceller.stdin.close()
            self._canceller = None

    def _signal_running(self, name: str) -> bool:
        """TERM to the processes of a worker's running job (or step); False when it has none yet."""
        assert self._queue is not None
        if self.allocation:
            step = self._queue.step(name)
            target = [step] if step else []
        else:
            job = self._queue.last(name)
            target = ["--me", f"--name={name}"] if job is not None and job.state == "RUNNING" else []
        if not target:
            return False
        try:
            self._run("scancel", "--signal=TERM", *target)
        except BackendError:
            return False
        return True

    def _cancel(self, names: Sequence[str]) -> None:
        for name in names:
            with contextlib.suppress(BackendError):
                self._run("scancel", f"--name={name}", "--me", "--full")

    # ---------------------------------------------------------------- after a session died

    @classmethod
    def cleanup(cls, dry_run: bool, options: Mapping[str, Any]) -> list[str]:
        """Cancel this user's jobs that a session of this host started and whose process is gone."""
        env = dict(os.environ)
        if options.get("slurm_conf"):
            env["SLURM_CONF"] = str(options["slurm_conf"])
        if shutil.which("squeue", path=env.get("PATH")) is None:
            raise ConfigError(f"no Slurm here: {INSTALL_HINT}")
        queued = commands.parse_squeue(slurm_command(["squeue", "-h", "--me", "-o", commands.SQUEUE_FORMAT], env))
        host, ended = socket.gethostname(), []
        for job in queued:
            mark = commands.parse_comment(job.comment)
            if not mark or mark["host"] != host or not job.name.startswith(commands.JOB_PREFIX):
                continue
            if mark["pid"].isdigit() and os.path.exists(f"/proc/{mark['pid']}"):
                continue  # its session runs
            if not dry_run:
                with contextlib.suppress(BackendError):
                    slurm_command(["scancel", "--full", job.job_id], env)
            ended.append(f"slurm job {job.job_id} ({job.name})")
        return ended


def _allocation(within: bool | None, options: commands.JobOptions) -> str:
    """The job id of the allocation whose steps the workers are ("" for jobs of their own), checked."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if within is None:
        within = bool(job)
    if not within:
        return ""
    if not job:
        raise ConfigError(
            "within_allocation=True: this process runs in no Slurm allocation (no SLURM_JOB_ID); start the "
            "notebook with sbatch or salloc, or leave within_allocation out for jobs of their own"
        )
    given = [f for f in ("partition", "account", "qos", "time_limit", "signal_before_end") if getattr(options, f)]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: inside allocation {job} these are the allocation's; leave them out, or give "
            "within_allocation=False for workers as jobs of their own"
        )
    return job
