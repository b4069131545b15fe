"""Workers as Slurm jobs: Slurm places them, with the cores, memory and GPUs each asks for.

    cdsw.use_backend("slurm", partition="gpu", account="proj42", time_limit="2:00:00")

This machine is a Slurm submit host (a login node, or a machine whose ``slurm.conf`` names the cluster's
controller and whose munge key is the cluster's). One launch of several workers is one job, a gang: an
allocation of one task per worker (``salloc --no-shell``), which Slurm grants whole or not at all, so that a
distributed job never runs on part of its workers while the rest wait; each worker is then a step of it,
one ``srun`` here running the worker's agent under the task launcher (task.py), which dials home to the
session as on every backend. A single worker, or every worker with gang=False, is a job of its own (one
``srun``). One lifeline for the session's jobs cancels them all should this process die. Where the
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
from ...logfile import WorkerOutput, read_tail
from ...ports import route_address
from ...workers import Resources, Status, WorkerSpec
from ..base import OUTPUT_DRAIN_SECONDS, Backend, Capabilities, SessionContext, log_tail, signal_exit_code
from . import commands, task
from .gang import Gang
from .login import login_client
from .queue import JobQueue, slurm_command

log = logging.getLogger(__name__)

STOP_WAIT = 10.0  # seconds for srun to end once its job was cancelled
# What the worker keeps of this process's environment: how to run programs, never the notebook's variables.
PASSED_VARIABLES = ("PATH", "LANG", "LC_ALL", "HOME", "USER", "LOGNAME")
INSTALL_HINT = "apt-get install slurm-client (Debian; the same Slurm version as the cluster's), with munge"


SALLOC_ANSWER = 30.0  # seconds for salloc to say the gang job was submitted (or why not)
SRUN_ERROR_BYTES = 4096  # what is read of srun's own messages for a worker's exit reason
NEVER_RAN = 1  # the exit code of a gang's worker whose allocation ended before it was granted


@dataclass(eq=False)
class SlurmHandle:
    worker_id: str
    job_name: str  # its job's, or its step's where it is a step of an allocation
    process: asyncio.subprocess.Process | None  # srun; None while its gang waits to be granted
    output: WorkerOutput
    log_path: str
    allocation: str = ""  # the job whose step it is: the session's own allocation or its gang's
    gang: Gang | None = None
    starting: asyncio.Task[None] | None = None  # a gang's worker: its step starts once the gang is granted
    start_error: str = ""  # why that never happened
    final: commands.QueuedJob | None = None  # its job's state once it ended (a gang's: the gang job's)

    @property
    def job(self) -> str:
        """The name of the job whose state is this worker's in Slurm's queue."""
        return self.gang.name if self.gang is not None else self.job_name


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
    gang: one launch of several workers is one job, granted whole or not at all (salloc --no-shell;
        GPUs asked per task, --gpus-per-task, which needs select/cons_tres; the extra options go to the
        allocation); False: each worker a job of its own, each starting when a place frees. Default: True.
    within_allocation: each worker a step of the Slurm allocation this process runs in (srun --jobid
        --overlap), as for a notebook that sbatch, batchspawner or Open OnDemand started; False: jobs of
        their own. Default: inside one when this process has SLURM_JOB_ID.
    login: "[user@]host" of a login node that this machine reaches over SSH, where Slurm's commands are
        (this machine needs no Slurm, munge or slurm.conf then): every Slurm command, srun and salloc run
        there through ssh, each srun under a lifeline that cancels its job should the connection (the
        session) die. python= must run cmlcluster there too. The nodes must still reach this machine
        (controller_ip; default: this machine's address on its route to the login node).
    login_port, identity, known_hosts, trust_on_first_use, ssh_options: how ssh logs into it, as for the
        ssh backend: its host key pinned in known_hosts (ssh's own by default), an unknown or changed key
        refused unless trust_on_first_use is asked for by name.
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
        gang: bool = True,
        login: str = "",
        login_port: int = 22,
        identity: str | None = None,
        known_hosts: str | None = None,
        trust_on_first_use: bool = False,
        ssh_options: Sequence[str] = (),
    ):
        self.options = commands.job_options(partition, account, qos, time_limit, signal_before_end, gpus, extra)
        if not isinstance(gang, bool):
            raise ConfigError(f"gang={gang!r}: give True (a launch is one job, all or none) or False (a job each)")
        self.gang = gang
        self.login, self.login_ssh = login_client(
            login, login_port, identity, known_hosts, trust_on_first_use, ssh_options
        )
        if self.login and within_allocation:
            raise ConfigError(
                f"login={login!r} and within_allocation=True: a notebook that reaches Slurm over SSH runs in no "
                "allocation of it; leave one of them out"
            )
        self.allocation = "" if self.login else _allocation(within_allocation, self.options)
        if not isinstance(python, str) or not python:
            raise ConfigError(f"python={python!r}: give the interpreter's path on the nodes")
        if slurm_conf is not None and not self.login and not os.path.isfile(os.path.expanduser(slurm_conf)):
            raise ConfigError(f"slurm_conf={slurm_conf!r}: no such file; give the path of the cluster's slurm.conf")
        if isinstance(shared_paths, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in shared_paths):
            raise ConfigError(f"shared_paths={shared_paths!r}: give a list of absolute folders every node sees")
        self.python = python
        # Slurm's commands run with this environment: the allocation given explicitly (--jobid) where they need
        # it, never through the variables the notebook's job set (SLURM_NTASKS, SLURM_MEM_PER_NODE, ... would
        # be a step's defaults).
        self.slurm_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        self.slurm_conf = slurm_conf
        if slurm_conf is not None and not self.login:
            self.slurm_env["SLURM_CONF"] = os.path.abspath(os.path.expanduser(slurm_conf))
        self.shared_paths = tuple(shared_paths)
        self._controller_ip = controller_ip
        self._queue: JobQueue | None = None
        self._handles: dict[str, SlurmHandle] = {}
        self._gangs: dict[str, Gang] = {}  # worker id -> the gang it starts in (until its start)
        # Submit mode: the session's jobs' lifeline. A plain process, not an asyncio one: it lives as long as
        # the backend is attached, and no event loop of the caller's need outlive it.
        self._canceller: subprocess.Popen[bytes] | None = None

    def capabilities(self) -> Capabilities:
        # Workers share their node's address; the session's disk is not theirs, unless the site shares it.
        return Capabilities(own_address=False, session_host=False, python=self.python, shared_paths=self.shared_paths)

    def controller_ip(self) -> str:
        if self._controller_ip is None and self.login:
            self._controller_ip = route_address(self.login)
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
        if self._gang_of(n):
            commands.check_gang_fits(n, resources, nodes, self.options.partition)

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        if self.login_ssh is not None:
            self.login_ssh.silence_timeout = context.silence_timeout
        for tool in ("ssh",) if self.login else ("srun", "salloc", "squeue", "scancel", "sinfo", "scontrol"):
            if shutil.which(tool, path=self.slurm_env.get("PATH")) is None:
                hint = "install OpenSSH's client" if self.login else INSTALL_HINT
                raise ConfigError(f"the slurm backend needs {tool} on this machine's PATH: {hint}")
        await asyncio.to_thread(self._run, "squeue", "-h", "--me", "-o", "%i")  # reaches the controller, or says why
        self._queue = JobQueue(self.slurm_env, self.allocation, self._where)
        self._queue.start()
        if not self.allocation:
            # Should this process die (a killed kernel), its jobs end at once, not at the agents' silence
            # timeout: a lifeline (its own session, so that the notebook's Ctrl-C is not for it) that is told
            # each job's name and scancels them all once its input closes. One for the session, not a Python
            # process per worker beside its srun (bench/slurm_launch.py).
            cancel = json.dumps(["scancel", "--me", "--full"])
            if self.login:  # there: its input ends when ssh does, with this process or its connection
                canceller = self._where([self.python, "-m", "cmlcluster._lifeline", "--for-each-line", cancel])
            else:
                canceller = [sys.executable, _lifeline.__file__, "--for-each-line", cancel]
            self._canceller = subprocess.Popen(
                canceller,
                env=self.slurm_env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            _lifeline.guard_stdin(self._canceller)

    def _run(self, *argv: str) -> str:
        return slurm_command(self._where(list(argv)), self.slurm_env)

    def _where(self, argv: list[str]) -> list[str]:
        """A Slurm command as it runs where Slurm is: here, or on the login node through ssh."""
        if self.login_ssh is None:
            return argv
        conf = ["env", f"SLURM_CONF={self.slurm_conf}"] if self.slurm_conf else []
        return self.login_ssh.argv(self.login, "exec", *conf, *argv)

    # ---------------------------------------------------------------- the contract

    async def prepare_launch(self, specs: Sequence[WorkerSpec]) -> None:
        """A launch of several workers alike, in submit mode: one gang job for all of them, or the free places
        of one the session holds (see Gang)."""
        if self.allocation or not self.gang or len({s.resources for s in specs}) > 1:
            return
        assert self._queue is not None, "attach() first"
        resources = specs[0].resources
        for gang in {h.gang for h in self._handles.values() if h.gang is not None}:
            if gang.resources == resources and gang.size - len(gang.members) >= len(specs) and not gang.ended:
                if not gang.granted.done() or gang.granted.exception() is None:
                    gang.members.update(spec.worker_id for spec in specs)
                    self._gangs.update((spec.worker_id, gang) for spec in specs)
                    return
        if not self._gang_of(len(specs)):
            return
        name = commands.gang_name(self.context.session_id, specs[0].worker_id)
        self._tell_canceller(name)
        argv = commands.salloc_argv("salloc", name, self._comment(), len(specs), resources, self.options)
        try:
            salloc = await asyncio.create_subprocess_exec(
                *self._where(argv), env=self.slurm_env, cwd=self.context.session_dir, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise BackendError(f"could not start salloc: {e}") from e
        gang = Gang(name, salloc, len(specs), resources, {spec.worker_id for spec in specs})
        submitted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        gang.reader = asyncio.create_task(gang.follow_salloc(submitted))
        try:
            gang.job_id = await asyncio.wait_for(asyncio.shield(submitted), SALLOC_ANSWER)
        except BaseException as e:
            await self._end_gang(gang)
            if isinstance(e, asyncio.TimeoutError):
                raise BackendError(f"salloc had no answer from Slurm within {SALLOC_ANSWER:g} s") from None
            raise
        self._queue.watch(name)
        self._gangs.update((spec.worker_id, gang) for spec in specs)

    def _gang_of(self, n: int) -> bool:
        """Whether a launch of n workers is one gang job."""
        return self.gang and n > 1 and not self.allocation

    async def start(self, spec: WorkerSpec) -> SlurmHandle:
        assert self._queue is not None, "attach() first"
        name = commands.job_name(self.context.session_id, spec.worker_id)
        log_path = self.context.log_path(spec.worker_id)
        gang = self._gangs.pop(spec.worker_id, None)
        if gang is not None:
            # Its step starts once Slurm grants the gang: meanwhile it is "scheduling", with the gang's reason.
            output = WorkerOutput(log_path)
            handle = SlurmHandle(spec.worker_id, name, None, output, log_path, allocation=gang.job_id, gang=gang)
            handle.starting = asyncio.create_task(self._start_step(handle, spec))
        else:
            if self.allocation:
                # Under a lifeline of its own: should this process die, srun is sent TERM, which cancels its
                # step (srun killed outright would leave the step running until the agent's silence timeout).
                srun = commands.step_argv(
                    "srun", self.allocation, name, spec.resources, self.options, self.python, self._worker(spec)
                )
                argv = [sys.executable, _lifeline.__file__, "--term-first", str(STOP_WAIT), "--", *srun]
                stdin = asyncio.subprocess.PIPE  # the lifeline's: this process holds its only writing end
            else:
                argv = commands.srun_argv(
                    "srun", name, self._comment(), spec.resources, self.options, self.python, self._worker(spec)
                )
                self._tell_canceller(name)  # before the job exists
                stdin = asyncio.subprocess.DEVNULL  # srun would pass it to the worker
            output = WorkerOutput(log_path)  # the worker's own output: the step's stdout
            handle = SlurmHandle(spec.worker_id, name, None, output, log_path, allocation=self.allocation)
            try:
                handle.process = await self._srun(argv, stdin, spec, handle)
            finally:
                output.handed_over()
        self._handles[spec.worker_id] = handle
        self._queue.watch(handle.job)
        return handle

    async def _start_step(self, handle: SlurmHandle, spec: WorkerSpec) -> None:
        """A gang's worker: its step, once the gang is granted (or never, when its allocation ends first)."""
        gang = handle.gang
        assert gang is not None and self._queue is not None
        try:
            try:
                await asyncio.shield(gang.granted)
            except BackendError as e:
                handle.start_error = str(e)
                return
            self._queue.follow_steps(gang.job_id)
            argv = commands.step_argv(
                "srun", gang.job_id, handle.job_name, spec.resources, self.options, self.python, self._worker(spec),
                gang=True,
            )  # fmt: skip
            try:
                handle.process = await self._srun(argv, asyncio.subprocess.DEVNULL, spec, handle)
            except BackendError as e:
                handle.start_error = str(e)
        finally:
            handle.output.handed_over()

    def _worker(self, spec: WorkerSpec) -> list[str]:
        return [self.python, *spec.argv[1:]]

    def _comment(self) -> str:
        return commands.job_comment(self.context.session_id, socket.gethostname(), os.getpid())

    def _tell_canceller(self, name: str) -> None:
        """The session's lifeline is told each job's name before the job exists."""
        assert self._canceller is not None and self._canceller.stdin is not None, "attach() first"
        try:
            self._canceller.stdin.write(f"--name={name}\n".encode())
            self._canceller.stdin.flush()
        except OSError as e:  # it was killed: the job runs all the same, without it
            log.warning("cmlcluster: the session's Slurm lifeline is gone (%s): should this process die, "
                        "job %s runs until its agents' silence_timeout", e, name)  # fmt: skip

    async def _srun(
        self, argv: list[str], stdin: int, spec: WorkerSpec, handle: SlurmHandle
    ) -> asyncio.subprocess.Process:
        worker_env = {**spec.env, task.GPUS_ENV: str(spec.resources.nvidia_gpu)}
        if self.login:
            # On the login node, under a lifeline: the worker's variables (its keys) arrive on its first line of
            # input, never on a command line; the end of the input (this process, or its connection, gone)
            # TERMs srun, which cancels the job or step.
            lifeline = [self.python, "-m", "cmlcluster._lifeline", "--term-first", str(STOP_WAIT), "--env-line", "--"]
            argv, env, stdin = self._where([*lifeline, *argv]), self.slurm_env, asyncio.subprocess.PIPE
        else:
            env = {k: self.slurm_env[k] for k in (*PASSED_VARIABLES, "SLURM_CONF") if k in self.slurm_env}
            env.update(worker_env)
        try:
            # srun's own messages ("srun: error: ... task 0: Killed", slurmstepd's "*** STEP CANCELLED ***")
            # go beside the worker's log, not into it: what a worker printed last stays its own last line.
            with open(handle.log_path + ".srun", "ab") as messages:
                process = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=self.context.session_dir, stdin=stdin,
                    stdout=handle.output.write_fd, stderr=messages, start_new_session=True,
                )  # fmt: skip
        except OSError as e:
            handle.output.close()
            raise BackendError(f"could not start srun for worker {spec.worker_id}: {e}") from e
        if stdin == asyncio.subprocess.PIPE:  # a lifeline's
            _lifeline.guard_stdin(process)
        if self.login:
            assert process.stdin is not None
            process.stdin.write(json.dumps(worker_env).encode() + b"\n")  # kept open: the lifeline
            with contextlib.suppress(ConnectionError):
                await process.stdin.drain()
        return process

    async def poll(self, handle: SlurmHandle) -> int | None:
        if handle.process is None:  # a gang's worker, not started (yet)
            return NEVER_RAN if handle.starting is not None and handle.starting.done() else None
        code = handle.process.returncode
        return None if code is None else signal_exit_code(code)

    async def wait(self, handle: SlurmHandle) -> int:
        if handle.starting is not None:
            await asyncio.wait([handle.starting])
        code = NEVER_RAN if handle.process is None else await handle.process.wait()
        await handle.output.drain(OUTPUT_DRAIN_SECONDS)
        await self._settle(handle)
        return signal_exit_code(code)  # srun says a task killed by signal N exited 128+N

    async def _settle(self, handle: SlurmHandle) -> None:
        """Its job's last state, for exit_reason and exit_status (a gang's job goes on for its other workers:
        running, it has nothing to say of this one's end), and its place in a gang given up."""
        if self._queue is not None and handle.final is None:
            await asyncio.to_thread(self._queue.settle, handle.job, may_run_on=handle.gang is not None)
            handle.final = self._queue.last(handle.job)
            if handle.gang is None:
                self._queue.unwatch(handle.job)
        gang = handle.gang
        if gang is not None and handle.worker_id in gang.members:
            gang.members.discard(handle.worker_id)
            if not gang.members:
                await self._end_gang(gang)

    async def _end_gang(self, gang: Gang) -> None:
        """Cancel a gang job whose workers all ended (or that the launch gave up), and forget it."""
        if gang.ended:
            return
        gang.ended = True
        if gang.job_id:
            await asyncio.to_thread(self._cancel_job, gang.job_id)
        else:  # salloc said nothing yet: its job, if there is one, by its name
            await asyncio.to_thread(self._cancel, [gang.name])
        if gang.salloc.returncode is None:  # still waiting for its grant: the cancel ends it, or this does
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(gang.salloc.wait(), STOP_WAIT)
            if gang.salloc.returncode is None:
                signal_group(gang.salloc.pid, signal.SIGKILL)
        if gang.reader is not None:
            await asyncio.wait([gang.reader])
        if self._queue is not None:
            # Until Slurm has it ended (COMPLETING meanwhile): what a stop reports finished has given its
            # nodes back, for the next launch.
            await asyncio.to_thread(self._queue.settle, gang.name)
            self._queue.unwatch(gang.name)
            if gang.job_id:
                self._queue.follow_steps(gang.job_id, following=False)

    async def stop(self, handle: SlurmHandle, grace: float = 5.0) -> None:
        if handle.starting is not None and not handle.starting.done():
            assert handle.gang is not None
            if not handle.gang.granted.done():  # its gang still waits: it never runs
                handle.starting.cancel()
            await asyncio.wait([handle.starting])  # else its srun is being started: stopped as any
        process = handle.process
        if process is None:
            await handle.output.drain(OUTPUT_DRAIN_SECONDS)
            await self._settle(handle)
            return
        if process.returncode is None and await asyncio.to_thread(self._signal_running, handle):
            # TERM to the worker's processes, its job or step left to end with them: the worker's cleanup runs
            # and its last lines reach srun. (srun itself, sent TERM, cancels the step: its tasks are killed.)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), grace)
        if process.returncode is None:  # still queued, or it did not end: its job or step is cancelled
            if handle.allocation:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)  # srun (through its lifeline, if any) cancels its step
            else:
                await asyncio.to_thread(self._cancel, [handle.job_name])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), STOP_WAIT)
        if process.returncode is None:
            signal_group(process.pid, signal.SIGKILL)  # srun (and its lifeline, in an allocation)
        await process.wait()
        await handle.output.drain(OUTPUT_DRAIN_SECONDS)
        await self._settle(handle)

    def output(self, handle: SlurmHandle) -> str:
        return log_tail(handle.log_path)

    def exit_reason(self, handle: SlurmHandle) -> str | None:
        job = handle.final
        if job is None or job.state not in commands.ENDED_AS:
            return handle.start_error or _srun_error(handle.log_path + ".srun")
        reason = f", {job.reason}" if job.reason and job.reason != "None" else ""
        return f"Slurm ended its job {job.job_id}: {job.state}{reason}"

    def exit_status(self, handle: SlurmHandle) -> Status | None:
        return commands.ENDED_AS.get(handle.final.state) if handle.final is not None else None

    def waiting_reason(self, handle: SlurmHandle) -> str | None:
        return self._queue.waiting_reason(handle.job) if self._queue is not None else None

    async def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        # The session stopped every worker; this is for one whose stop failed, and a launch given up.
        handles = self._handles.values()
        left = [h.job_name for h in handles if h.gang is None and h.process and h.process.returncode is None]
        if left:
            await asyncio.to_thread(self._cancel, left)
        for gang in {*self._gangs.values(), *(h.gang for h in handles if h.gang is not None)}:
            await self._end_gang(gang)
        self._handles, self._gangs = {}, {}
        if self._canceller is not None:  # nothing is left for it to cancel: it goes without a word
            self._canceller.kill()
            self._canceller.wait()
            if self._canceller.stdin is not None:
                self._canceller.stdin.close()
            self._canceller = None

    def _signal_running(self, handle: SlurmHandle) -> bool:
        """TERM to the processes of a worker's running job (or step); False when it has none yet."""
        assert self._queue is not None
        name = handle.job_name
        if handle.allocation:
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

    def _cancel_job(self, job_id: str) -> None:
        with contextlib.suppress(BackendError):
            self._run("scancel", job_id)

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


def _srun_error(path: str) -> str | None:
    """srun's last error (a step Slurm would not create, say), from its messages beside the worker's log."""
    errors = [line.strip() for line in read_tail(path, SRUN_ERROR_BYTES).splitlines() if "error:" in line]
    return errors[-1] if errors else None


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
