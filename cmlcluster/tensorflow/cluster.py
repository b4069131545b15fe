"""TensorFlow clusters on a session's workers: run_cluster (Cloudera's), start_cluster and TFCluster.

One worker per TensorFlow task. The session launches them, learns their
addresses, and then, over the control plane, starts a tf.distribute.Server in
each (job name + task index) or runs a script in each with its TF_CONFIG.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .. import checks, wire
from ..api import get_session
from ..errors import CmlClusterError, ConfigError, SharedMachineWarning
from ..events import JobFailure, Member
from ..jobs import Job, JobFailed, Restarts, Role, launch_job
from ..ports import free_ports
from ..runs.options import worker_options
from ..session import Session
from ..shipping import Shipment
from ..workers import Program, Resources, user_file
from . import coordinator, layout, stopping, versions

log = logging.getLogger(__name__)

TASK = "cmlcluster.tensorflow.task"
SERVER_READY_TIMEOUT = 30.0
COORDINATOR_JOB = "chief"  # this process's job in a cluster it coordinates
LOST_TASK_WAIT = 5.0  # seconds a TensorFlow error in the coordinator waits for the session to name a lost task
_TOLD: weakref.WeakSet[Session] = weakref.WeakSet()  # sessions warned that other users reach their servers


@dataclass(frozen=True)
class TaskWorker:
    """A TensorFlow task and the worker it runs in."""

    job: str
    index: int
    address: str
    worker_id: str


class TFCluster:
    """A running TensorFlow cluster: its workers, its ClusterSpec, and ways to train on it.

    Use it as a context manager or call stop(). The notebook can be the coordinator
    (``tf.distribute.ParameterServerStrategy(cluster.resolver)``), or every worker
    task can run a script (``run_script`` with TF_CONFIG, ``run_cml_script`` with
    Cloudera's run(cluster, server, task_index)).
    """

    def __init__(
        self, session: Session, tasks: Sequence[TaskWorker], servers: bool, job: Job, chief: str | None = None
    ):
        self.session = session
        self.tasks = list(tasks)
        self.servers = servers
        self.chief = chief  # the coordinator's address, in this process
        self.cluster_spec: layout.ClusterDict = _spec_of(self.tasks, chief)
        self.session_addr = f"grpc://{self.workers[0].address}"
        self.stopped = False
        # Tasks wait on each other: the first to end unexpectedly fails the cluster and stops the rest.
        self.job = job
        if chief is not None:  # this process coordinates: TensorFlow would wait for a lost worker forever
            job.on_failure(self._fail_coordinator)

    @property
    def workers(self) -> list[TaskWorker]:
        return [t for t in self.tasks if t.job == "worker"]

    @property
    def ps(self) -> list[TaskWorker]:
        return [t for t in self.tasks if t.job == "ps"]

    def tf_config(self, task_type: str = "worker", task_index: int = 0) -> dict[str, Any]:
        """The TF_CONFIG of one task of this cluster."""
        return layout.tf_config(self.cluster_spec, task_type, task_index)

    @property
    def resolver(self) -> Any:
        """A cluster resolver that makes this process the coordinator ("chief") of the cluster.

        ``tf.distribute.ParameterServerStrategy(cluster.resolver)`` then runs the steps
        of ``model.fit`` on the workers, with the variables on the parameter servers.
        """
        if self.chief is None:
            raise CmlClusterError(
                "this cluster has no coordinator task; start it with start_cluster(..., coordinator=True)"
            )
        import tensorflow as tf

        versions.check_coordinator(tf)
        coordinator.guard_recovery(self.cluster_spec, COORDINATOR_JOB)  # before the strategy can lose a worker
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster_spec), task_type=COORDINATOR_JOB, task_id=0, rpc_layer="grpc"
        )
        return stopping.stoppable(resolver, self)  # the widget's Stop ends model.fit on it

    def run_script(self, script: str, args: Sequence[str] = (), timeout_seconds: float = 0) -> list[dict[str, Any]]:
        """Run `script args` as __main__ on every worker task, each with its own TF_CONFIG.

        This is the MultiWorkerMirroredStrategy path (start the cluster with
        servers=False: the strategy starts its own server from TF_CONFIG).
        Waits for all of them; returns their worker dicts, or raises WorkerError.
        """
        shipment, name = self._ship(script)
        programs = {
            t.worker_id: shipment.program(
                target=f"{TASK}:run_script", args=(name, self.tf_config(t.job, t.index), tuple(args))
            )
            for t in self.workers
        }
        return self._run_programs(programs, timeout_seconds)

    def _ship(self, script: str) -> tuple[Shipment, str]:
        """The script's file, for workers that do not see it; a module name travels as it is."""
        script = check_script(script)
        shipment = self.session.ship([script] if os.path.isfile(script) else [])
        return shipment, shipment.names.get(script, script)

    def run_cml_script(self, script: str, timeout_seconds: float = 0) -> list[dict[str, Any]]:
        """Cloudera's convention: every worker task calls the script's run(cluster, server, task_index)."""
        if not self.servers:
            raise CmlClusterError("run(cluster, server, task_index) needs the servers; start with servers=True")
        shipment, name = self._ship(script)
        programs = {
            t.worker_id: shipment.program(target=f"{TASK}:run_cml_script", args=(name, self.cluster_spec, t.index))
            for t in self.workers
        }
        return self._run_programs(programs, timeout_seconds)

    def _run_programs(self, programs: Mapping[str, Program], timeout_seconds: float) -> list[dict[str, Any]]:
        if self.stopped:
            raise CmlClusterError("this cluster is stopped; start a new one")
        self.job.raise_if_failed()
        try:
            for worker_id, program in programs.items():
                self.session.run_program([worker_id], program)
            done = self.session.wait_for(
                list(programs), wait_for_completion=True, timeout_seconds=timeout_seconds, fail_fast=True
            )
        except BaseException as e:  # Ctrl-C, or the session failed under us: nothing of the cluster stays
            self.stop()
            if isinstance(e, KeyboardInterrupt):
                log.warning(
                    "cmlcluster: interrupted; the TensorFlow cluster's %d workers were stopped", len(self.tasks)
                )
            raise
        if self.job.failure is not None:  # a task (a parameter server, say) ended: the job names it
            self.stop()  # its other workers are on their way out; the error says they are gone
            self.job.raise_if_failed()
        if done.failures:  # none failed, but some were stopped on request or did not finish in time
            self.stop()
            reasons = "\n".join(f"  {self.job.member(f.id)}: {f.message or f.status}" for f in done.failures)
            raise CmlClusterError(f"the TensorFlow cluster's tasks did not all finish; it was stopped:\n{reasons}")
        return [w.to_dict() for w in done.workers]  # CML's dicts: what run_cluster's callers get

    def _fail_coordinator(self, failure: JobFailure) -> None:
        coordinator.fail(self.cluster_spec, self.job.error())

    def _take_back(self, lost: Member, new: Member) -> None:
        """Make `new` the lost worker task: its server at the lost one's address, which TensorFlow's
        coordinator waits for (its preemption handler, see coordinator.py) and then trains on again,
        rebuilding the task's datasets. The parameter servers kept the variables: nothing is lost."""
        i, task = next((i, t) for i, t in enumerate(self.tasks) if t.worker_id == lost.worker_id)
        again = TaskWorker(task.job, task.index, task.address, new.worker_id)
        call = f"{TASK}:start_server"
        self.session.call(new.worker_id, call, self.cluster_spec, task.job, task.index, timeout=SERVER_READY_TIMEOUT)
        _wait_reachable([again], SERVER_READY_TIMEOUT)
        self.tasks[i] = again

    @property
    def restarts(self) -> int:
        """How many lost worker tasks were replaced (start_cluster's max_restarts)."""
        return self.job.restarts

    @property
    def failure(self) -> Any:
        """The JobFailure that ended this cluster (which task's worker ended, and why), or None."""
        return self.job.failure

    def stop(self) -> None:
        """Stop every task's worker (TensorFlow servers end with their process).

        If this process coordinated the cluster, it is detached first, while the servers
        still answer, so that TensorFlow never talks to them again (see coordinator.py).
        """
        self.job.finish()
        if not self.stopped and self.chief is not None and self.failure is None:
            # Not after a failure: TensorFlow's preemption handler then blocks in update_server_def
            # waiting for the lost worker, holding the lock that stopping its coordinator needs.
            coordinator.detach(self.cluster_spec)
        if not self.stopped and not self.session.closed:
            # The job's members too: a replacement joins them before its task is taken back.
            self.session.stop_workers(*dict.fromkeys([*(t.worker_id for t in self.tasks), *self.job.worker_ids]))
        self.stopped = True

    def __enter__(self) -> TFCluster:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and self.failure is None and hasattr(exc, "error_code"):  # a tf.errors.OpError
            # TensorFlow can see a task's death (connection reset) before the session does:
            # give the session a moment, so that the error names the task that died.
            self.job.failed.wait(LOST_TASK_WAIT)
        self.stop()
        if exc is not None and self.failure is not None and not isinstance(exc, JobFailed):
            # What TensorFlow raised in this process (UnavailableError, say) follows from this.
            raise self.job.error() from exc
        unsupported = versions.fit_error(exc) if exc is not None and self.chief is not None else None
        if unsupported is not None:  # Keras 3's own error does not say that fit cannot train here
            raise unsupported from exc

    def tensorboard(self, logdir: str, port: int | None = None) -> Any:
        """TensorBoard on the cluster's log folder, stopped with the session (see Session.tensorboard)."""
        return self.session.tensorboard(logdir, port)

    def _ipython_display_(self) -> None:
        self.session._ipython_display_()  # the session's widget: the cluster's rows are in it

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "running"
        return f"<TFCluster {state} ps={len(self.ps)} worker={len(self.workers)} {self.cluster_spec}>"


def start_cluster(
    n_workers: int,
    n_ps: int = 0,
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    *,
    port: int = layout.DEFAULT_PORT,
    servers: bool = True,
    coordinator: bool | None = None,
    min_workers: int | None = None,
    max_restarts: int = 0,
    timeout_seconds: float = 60,
    env: Mapping[str, str] | None = None,
    session: Session | None = None,
    collect: str | Sequence[str] | None = None,
) -> TFCluster:
    """Launch n_ps parameter servers (never with GPUs) and n_workers workers, and make them a cluster.

    One worker per TensorFlow task. The cluster outlives this call, on the default session unless
    `session` is given: use it as a context manager, or call its stop().

    Parameters
    ----------
    n_workers : int
        Worker tasks, 1 or more.
    n_ps : int, default 0
        Parameter servers, 0 or more; never with GPUs.
    cpu : float, default 1
        Cores per task.
    memory : float, default 1
        Memory per task, in GB.
    nvidia_gpu : int, default 0
        GPUs per worker task.
    port : int, default 2323
        The tasks' TCP port (never 2222, sshd's in every worker), on workers with addresses of their
        own (containers, pods) in a cluster this process does not coordinate; tasks sharing an address
        get port, port+1, ... Elsewhere each task gets a port picked free on its host.
    servers : bool, default True
        Every task runs its tf.distribute.Server, reachable before this returns. False: for a
        strategy that starts its own servers from TF_CONFIG (TFCluster.run_script).
    coordinator : bool | None, default None
        The spec also holds a "chief" task at this process's address, for TF2's
        ParameterServerStrategy with the notebook as coordinator (see TFCluster.resolver). None: the
        same as servers. True needs servers=True.
    min_workers : int | None, default None
        The cluster goes on with the workers that started if at least that many did (a warning names
        the others, which are stopped); from 1 to n_workers. None: every worker must start.
    max_restarts : int, default 0
        A worker task lost while this process coordinates is replaced, this many times in all, and
        training goes on (a lost parameter server still fails the cluster). Needs coordinator=True and a
        backend that can give a replacement the lost worker's address (local, ssh, or docker with its
        own session network).
    timeout_seconds : float, default 60
        Seconds for the workers to run, and then for their servers to start.
    env : Mapping[str, str] | None, default None
        Variables for every task.
    session : Session | None, default None
        The session to launch in; None: the default session (never one of the cluster's own).
    collect : str | Sequence[str] | None, default None
        Paths of each task's folder that come to this working folder when it ends (launch_workers').

    Returns
    -------
    TFCluster
        The running cluster: its cluster_spec, session_addr, tf_config(), resolver, run_script(),
        run_cml_script() and stop().

    Raises
    ------
    ConfigError
        Before anything starts: n_workers, n_ps or min_workers out of range; cpu, memory or nvidia_gpu
        out of range; timeout_seconds not above 0; a port that is no TCP port, or 2222; coordinator=True
        with servers=False; max_restarts not a whole number, 0 or more, or without a coordinator, or on
        a backend that cannot keep a worker's address; a bad env or collect entry.
    cmlcluster.jobs.JobStartFailed
        Fewer workers than min_workers (all of them, without it) or not every parameter server
        started; every worker that did was stopped.
    WorkerError
        A task's server did not start in its worker.
    CmlClusterError
        A task's server did not accept connections within 30 s.

    Warns
    -----
    SharedMachineWarning
        Once per session, where TensorFlow's servers start on this machine (the local backend's
        workers, or this process's own as coordinator): every user of the machine can reach them.

    Examples
    --------
    ::

        with cdsw.start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2) as cluster:
            strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)

        with cdsw.start_cluster(n_workers=2, servers=False, cpu=1, memory=2) as cluster:
            cluster.run_script("worker_scripts/tf_multiworker_train.py", args=["--epochs", "3"])
    """
    min_workers = layout.check_counts(n_workers, n_ps, min_workers)
    if not checks.number(timeout_seconds, above=0):  # Cloudera's name for it, not every other run's start_timeout
        raise ConfigError(f"timeout_seconds={timeout_seconds!r}: give the seconds the workers have to start, above 0")
    options = worker_options(
        cpu=cpu,
        memory=memory,
        nvidia_gpu=nvidia_gpu,
        env=env,
        session=session,
        start_timeout=timeout_seconds,
        max_restarts=max_restarts,
        collect=collect,
    )
    layout.check_port(port)
    if coordinator is None:
        coordinator = servers
    if coordinator and not servers:
        raise ConfigError("coordinator=True needs servers=True: a coordinator drives running servers")
    # The cluster outlives this call: never a session of its own (it is no run: runs/skeleton.py).
    session = options.session or get_session()
    layout.check_restarts(max_restarts, coordinator, session.backend.capabilities().stable_addresses)
    env = {**versions.legacy_keras_env(), **options.env}  # the workers' tf.keras is the notebook's
    if servers:  # imported while the workers register, not once start_server is called
        env.setdefault(wire.PRELOAD_ENV, "tensorflow")
    task, paths = options.resources, options.collect
    roles = [
        Role("ps", n_ps, Resources(cpu, memory, 0), env=env, collect=paths),  # never a GPU
        Role("worker", n_workers, task, min_count=min_workers, env=env, replaceable=max_restarts > 0, collect=paths),
    ]
    built: list[TFCluster] = []  # the cluster, once it is: its replacements start their servers in it

    def take_back(lost: Member, new: Member) -> None:
        if not built:
            raise CmlClusterError("the cluster was still starting")
        built[0]._take_back(lost, new)

    restarts = Restarts(max_restarts, take_back, same_address=True) if max_restarts else None
    with session.showing("start_cluster"):
        job = launch_job(session, roles, "TensorFlow cluster", timeout_seconds=timeout_seconds, restarts=restarts)
    with ExitStack() as undo:
        undo.callback(job.stop)
        _warn_other_users(session, coordinator)  # once the backend knows where its workers are
        # Fixed ports only where no earlier cluster's address can come back to this process (see _assign_tasks).
        fixed = session.backend.capabilities().own_address and not coordinator
        tasks = _assign_tasks(session, job.members, port if fixed else None)
        # The coordinator runs here; workers reach this host where they reach the controller.
        chief = layout.join_address(session.controller_ip, free_ports(1)[0]) if coordinator else None
        if servers:
            spec = _spec_of(tasks, chief)
            session.call_each(
                [(t.worker_id, f"{TASK}:start_server", (spec, t.job, t.index)) for t in tasks],
                timeout=timeout_seconds or None,
            )
            _wait_reachable(tasks, SERVER_READY_TIMEOUT)
        cluster = TFCluster(session, tasks, servers, job, chief)
        built.append(cluster)
        undo.pop_all()
    return cluster


def run_cluster(
    n_workers: int,
    n_ps: int,
    cpu: float,
    memory: float,
    nvidia_gpu: int = 0,
    worker_script: str | None = None,
    timeout_seconds: float = 60,
    **options: Any,
) -> tuple[layout.ClusterDict | None, str | None]:
    """Cloudera's run_cluster: returns (cluster_spec, session_addr) of a running cluster.

    Every task runs its tf.distribute.Server, without a coordinator task: TF1-style, clients
    connect to session_addr. Without worker_script the cluster keeps running: stop_workers() stops
    it, on the default session.

    Parameters
    ----------
    n_workers : int
        Worker tasks, 1 or more.
    n_ps : int
        Parameter servers, 0 or more; never with GPUs.
    cpu : float
        Cores per task.
    memory : float
        Memory per task, in GB.
    nvidia_gpu : int, default 0
        GPUs per worker task.
    worker_script : str | None, default None
        A script every worker task runs: it calls the script's run(cluster, server, task_index) while
        the parameter servers serve; once the workers are done the cluster is stopped. A file here, or
        a module name the workers import (e.g. mypackage.train).
    timeout_seconds : float, default 60
        Seconds for the workers to run, and then for their servers to start (start_cluster's).
    **options : Any
        Other options are start_cluster's (port, min_workers, env, session, collect); servers=True
        and coordinator=False are set here, so max_restarts above 0 is refused. session: the default
        session when not given.

    Returns
    -------
    tuple[layout.ClusterDict | None, str | None]
        (cluster_spec, session_addr): ``{"worker": ["ip:port", ...], "ps": [...]}`` and
        ``"grpc://<worker 0>:<port>"``; with worker_script, (None, None).

    Raises
    ------
    ConfigError
        Before anything starts: a worker_script that is neither a file here nor a module name, or
        what start_cluster refuses.
    WorkerError
        With worker_script, a failing worker, named, with its traceback, after everything is stopped.
    CmlClusterError
        With worker_script, its tasks did not all finish (stopped on request, say); the cluster was
        stopped. Also start_cluster's errors when the cluster does not start (JobStartFailed,
        WorkerError, CmlClusterError).

    Examples
    --------
    ::

        cluster_spec, session_addr = cdsw.run_cluster(n_workers=2, n_ps=1, cpu=1, memory=2)
        cdsw.stop_workers()
        cdsw.run_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, worker_script="worker_scripts/tf_ps_train.py")
    """
    if worker_script is not None:
        worker_script = check_script(worker_script, "worker_script")  # before the cluster starts
    session = options["session"] = options.get("session") or get_session()
    with session.showing("run_cluster"):
        # TF1-style: clients connect to session_addr, so no coordinator task (a TF1 master
        # would wait forever for a chief that never serves).
        cluster = start_cluster(
            n_workers,
            n_ps,
            cpu,
            memory,
            nvidia_gpu,
            servers=True,
            coordinator=False,
            timeout_seconds=timeout_seconds,
            **options,
        )
        if worker_script is None:
            return cluster.cluster_spec, cluster.session_addr
        with cluster:
            cluster.run_cml_script(worker_script)
    return None, None


def check_script(script: object, name: str = "script") -> str:
    """A worker task's script as the workers get it: a file here (its absolute path, user_file's), else a
    module name the workers import, as it is; anything else is refused (ConfigError) before it runs. A name
    ending in .py is a file: `train.py` is never the module `py` of a package `train`."""
    if isinstance(script, str) and not script.endswith(".py") and not os.path.isfile(script):
        if all(part.isidentifier() for part in script.split(".")):
            return script
    return user_file(script, name=name)


def _warn_other_users(session: Session, coordinator: bool) -> None:
    """Once per session: TensorFlow's gRPC servers run the graphs anyone connecting sends (TensorFlow's
    SECURITY.md) and listen on every interface, so every user of this machine reaches those that run here:
    the workers' on a backend whose workers are on this machine, this process's own when it coordinates."""
    workers_here = session.backend.capabilities().session_machine
    if not (workers_here or coordinator) or session in _TOLD:
        return
    _TOLD.add(session)
    here = " and ".join(
        ([f"the workers' ({session.backend.name} backend)"] if workers_here else [])
        + (["this process's own (the notebook's or the script's), as coordinator"] if coordinator else [])
    )
    frame = _callers_frame()
    # warn_explicit with a registry of its own: shown for each session, where warnings.warn would say it
    # once per line of the notebook for the whole process.
    warnings.warn_explicit(
        f"TensorFlow's servers run whatever a connection sends them, and every user of this machine can connect "
        f"to those starting here: {here}. On a machine others use, run the workers on hosts only you reach "
        "(the ssh or kubernetes backend) and leave the coordinator off (run_cluster, or coordinator=False); "
        'docs/security.md. Alone on this machine: warnings.simplefilter("ignore", cmlcluster.SharedMachineWarning)',
        SharedMachineWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry={},
    )


def _callers_frame() -> FrameType:
    """The innermost frame outside cmlcluster: the user's call."""
    frame = sys._getframe(1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith("cmlcluster."):
        frame = frame.f_back
    return frame


def _assign_tasks(session: Session, members: Sequence[Member], port: int | None) -> list[TaskWorker]:
    """Give each task an address: its worker's IP, and a port of its own on that IP.

    With `port`, tasks use it (port, port+1, ... for tasks sharing an IP). With None, each gets a
    port picked free on its worker's host. Fixed ports go wrong where tasks share a host's address
    (anything else on the host may hold them), and in a cluster this process coordinates: a
    TensorFlow coordinator that lost an earlier cluster keeps trying to reach its lost task (its
    preemption handler, in update_server_def), and crashes the process when a new server answers
    at that address, as a container given the dead one's IP would at a fixed port.
    """
    if port is not None:
        ports = layout.assign_ports([m.address for m in members], port)
    else:
        by_address: dict[str, list[int]] = {}
        for i, m in enumerate(members):
            by_address.setdefault(m.address, []).append(i)
        asked = [(members[ids[0]].worker_id, "cmlcluster.ports:free_ports", (len(ids),)) for ids in by_address.values()]
        ports = [0] * len(members)
        for ids, free in zip(by_address.values(), session.call_each(asked), strict=True):
            for i, p in zip(ids, free, strict=True):
                ports[i] = p
    return [
        TaskWorker(m.role, m.index, layout.join_address(m.address, p), m.worker_id)
        for m, p in zip(members, ports, strict=True)
    ]


def _spec_of(tasks: Sequence[TaskWorker], chief: str | None = None) -> layout.ClusterDict:
    every = [layout.Task(t.job, t.index, t.address) for t in tasks]
    if chief is not None:
        every.append(layout.Task(COORDINATOR_JOB, 0, chief))
    return layout.spec_from_tasks(every)


def _wait_reachable(tasks: Sequence[TaskWorker], timeout: float) -> None:
    """Wait until every task's server accepts TCP connections from here."""
    deadline = time.monotonic() + timeout
    waiting = list(tasks)
    while waiting:
        task = waiting[0]
        host, port = layout.split_address(task.address)
        try:
            socket.create_connection((host, port), timeout=1).close()
            waiting.pop(0)
            continue
        except OSError as e:
            if time.monotonic() > deadline:
                raise CmlClusterError(
                    f"the TensorFlow server of {task.job} task {task.index} (worker {task.worker_id}) at "
                    f"{task.address} did not accept connections within {timeout:g} s: {e}"
                ) from None
        time.sleep(0.05)
