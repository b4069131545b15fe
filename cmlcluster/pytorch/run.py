"""run_torch: PyTorch distributed training (DDP and the rest of torch.distributed) on workers.

One worker per node, all launched together as one job. Worker 0's agent picks a port free
there; every worker then starts ``torchrun --node-rank i --master-addr <worker 0's address>
--master-port <that port>`` at once. Worker 0's opens the static rendezvous; every other one
first imports torch, then waits until it can connect to that endpoint, and only then joins
(launch.py), so that the check costs no time. torchrun sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process. Every process's output streams
back live as ``[rank r] text`` in its worker's output.

The first failure ends the run: a process that fails ends its node's torchrun, whose worker
reports which rank failed, with the traceback from torchrun's error file; a worker that ends
(killed, crashed) fails the job. Either way every other worker is stopped at once, and with
it every process it ran. The workers belong to the run and are stopped when it ends.

With max_restarts=N the run is elastic instead: the rendezvous is torchrun's c10d one, its store
hosted by the session (store.py), so that it outlives any worker. A worker lost mid-run is
replaced by the job (jobs.Restarts) with a new one of the same resources, whose node joins the
rendezvous; torchrun restarts the other nodes' processes, and they all resume from the script's
last snapshot (docs/guide/pytorch.md, "Surviving a lost worker").
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import queue
import re
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import checks
from ..backends import Backend
from ..collect.paths import check_collect
from ..errors import CmlClusterError, ConfigError, install_hint
from ..events import Event, JobFailure, Member, OutputLine
from ..jobs import Job, Restarts, Role, launch_job
from ..runs import RESULT_LINES_KEPT, report_end, send_files, session_for
from ..session import Session
from ..workers import FAILED, Resources, check_env, check_resources, user_file
from . import commands
from .result import RankFailure, TorchError, TorchResult
from .store import SessionStore

NODE = "cmlcluster.pytorch.node"
STOPPED_NODES_WAIT = 10.0  # seconds to wait for the other nodes' calls to end once the run failed
LOST_WORKER_WAIT = 5.0  # seconds for a node's worker status to arrive after its call failed
# After a node reports a failed rank, how long the other nodes' failures may take to arrive before the
# run names one: a rank's death breaks its peers' collectives within moments, and the peer whose
# torchrun ends first must not be named for a failure that only followed the real one.
FAILURE_WINDOW = 2.0
# The message of a rank that failed because a peer went away (Gloo's and NCCL's words for it).
PEER_LOST = re.compile(r"closed by peer|reset by peer|Broken pipe|Connection refused|NCCL communicator was aborted")

log = logging.getLogger(__name__)


def run_torch(
    script: str | Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    nnodes: int = 1,
    nproc_per_node: int | str = "auto",
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    dist_backend: str | None = None,
    backend: str | Backend | None = None,
    session: Session | None = None,
    start_timeout: float = 60,
    join_timeout: float = commands.DEFAULT_JOIN_TIMEOUT,
    rank0_only: bool = False,
    max_restarts: int = 0,
    ship_working_folder: bool = False,
    collect: str | Sequence[str] | None = None,
    echo: bool = True,
    check: bool = False,
) -> TorchResult:
    """Run `script args` (or `script(*args, **kwargs)` for a function) under torchrun on `nnodes` workers.

    One worker per node, launched together as one job; each starts torchrun, which sets RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process, and every process's output
    streams back as ``[rank r] text``. The first failure ends the run, and the workers belong to the
    run: they are stopped when it ends. Bad arguments are refused before any worker starts.

    Parameters
    ----------
    script : str | Callable[..., Any]
        The training script's path (relative to the working folder; shipped to workers that do not
        see it), or a function, pickled with cloudpickle, whose return value on rank 0 comes back as
        result.value.
    args : Sequence[Any], default ()
        A script's arguments, a list of strings (e.g. ``["--epochs", "3"]``); a function's
        positional arguments.
    nnodes : int, default 1
        Workers, one torchrun each: a whole number, 1 or more.
    nproc_per_node : int | str, default "auto"
        Processes per worker ("auto": its GPUs, or 1); with GPUs, at most nvidia_gpu.
    cpu : float, default 1
        Cores per worker, shared among its processes (OMP_NUM_THREADS).
    memory : float, default 1
        Memory per worker, in GB.
    nvidia_gpu : int, default 0
        GPUs per worker, a whole number, 0 or more.
    kwargs : Mapping[str, Any] | None, default None
        A function's keyword arguments; not for a script (pass its options in args).
    env : Mapping[str, str] | None, default None
        Variables for every worker. Workers get env= and cmlcluster's own variables
        (docs/guide/workers.md, "What workers see").
    dist_backend : str | None, default None
        What cmlcluster.pytorch.init_process_group() uses: "gloo", "nccl", "mpi" or "ucc"; None:
        "nccl" with GPUs, else "gloo" ("nccl" needs GPUs). Its name is in CMLCLUSTER_DIST_BACKEND.
    backend : str | Backend | None, default None
        Without `session`: run in a session of its own on this backend, closed when the run ends.
        None: the default session (cmlcluster.get_session()).
    session : Session | None, default None
        The session to run in.
    start_timeout : float, default 60
        Seconds, above 0, for the workers to run (and for a lost worker's replacement).
    join_timeout : float, default 120
        Seconds, above 0, for every node to reach worker 0's rendezvous (the session's, in an elastic
        run).
    rank0_only : bool, default False
        Stream only rank 0's output.
    max_restarts : int, default 0
        Replace a lost worker up to this many times in all, and restart the ranks (torchrun's elastic
        mode; the script resumes from its snapshot: docs/guide/pytorch.md); needs torch in this Python
        too, which hosts the rendezvous. 0: a static run, the first loss fails it.
    ship_working_folder : bool, default False
        Copy the working folder to workers that do not see it.
    collect : str | Sequence[str] | None, default None
        Paths under the workers' folders ("outputs", "checkpoints") whose files come to this working
        folder when each worker ends, where workers do not share it (launch_workers' collect=).
    echo : bool, default True
        Show the run in the session's view, and how it ended.
    check : bool, default False
        Raise TorchError instead of returning a failed result.

    Returns
    -------
    TorchResult
        What the run did: ok, exit_code, each rank's last lines (output), failed_rank and failure
        (the rank that failed first, and why), worker_failure (a worker that ended during the run),
        master, hosts, value (a function's, from rank 0) and restarts.

    Raises
    ------
    ConfigError
        Before any worker starts: nnodes, nproc_per_node, cpu, memory, nvidia_gpu, start_timeout,
        join_timeout or max_restarts out of range; an unknown dist_backend, or "nccl" without GPUs; max_restarts
        without torch in this Python; kwargs with a script, or a script that is neither a file nor a
        function; args of a script that are not strings; a function that cannot be pickled, or no
        cloudpickle; a bad env or collect entry.
    cmlcluster.jobs.JobStartFailed
        A node's worker did not start; every worker that did was stopped.
    TorchError
        With check=True, the run failed; its `result` is the TorchResult.
    KeyboardInterrupt
        Ctrl-C: raised again once every worker, and every process they ran, was stopped.

    Examples
    --------
    ::

        result = cmlcluster.run_torch("train.py", ["--epochs", "3"], nnodes=2, nproc_per_node=2)
        result.ok, result.exit_code, result.output[3], result.failed_rank, result.failure, result.master
        result = cmlcluster.run_torch("train.py", nnodes=4, max_restarts=2)  # a lost worker replaced, twice at most

        def train(lr):  # a function, pickled to the workers
            ...
            return accuracy

        cmlcluster.run_torch(train, (0.1,), nnodes=2).value  # rank 0's return value
    """
    # Everything is checked before anything starts.
    paths = check_collect(collect)
    if not checks.whole(nnodes, 1):
        raise ConfigError(f"nnodes={nnodes!r}: give a whole number of workers, 1 or more")
    check_resources(cpu, memory, nvidia_gpu)
    nproc = commands.nproc_for(nproc_per_node, nvidia_gpu)
    process_group = commands.dist_backend_for(dist_backend, nvidia_gpu)
    for name, seconds in (("join_timeout", join_timeout), ("start_timeout", start_timeout)):
        if not checks.number(seconds, above=0):
            raise ConfigError(f"{name}={seconds!r}: give a number of seconds above 0")
    if not checks.whole(max_restarts, 0):
        raise ConfigError(f"max_restarts={max_restarts!r}: give a whole number of workers to replace, 0 or more")
    if max_restarts and importlib.util.find_spec("torch") is None:
        raise ConfigError(
            f"max_restarts={max_restarts} needs PyTorch here too ({sys.executable}): the session hosts the "
            "rendezvous that outlives any worker; pip install torch, or pass max_restarts=0"
        )
    env = check_env(env)
    if callable(script):
        call = _pickled_call(script, tuple(args), dict(kwargs or {}))
        script_args: list[str] = []
        path = ""
    else:
        if kwargs:
            raise ConfigError("kwargs= is for a function; pass a script's options in args=[...]")
        if not isinstance(script, (str, os.PathLike)):
            raise ConfigError(f"script={script!r}: give the path of the training script, or a function")
        call, path, script_args = b"", user_file(script), commands.check_script_args(args)

    title = f"run_torch {os.path.basename(path) or getattr(script, '__name__', 'function')}"
    with session_for(session, backend, echo, title) as session:
        return _run_job(
            session,
            nnodes=nnodes,
            nproc=nproc,
            resources=Resources(cpu, memory, nvidia_gpu),
            env=dict(env or {}),
            plan={
                "call": call,
                "args": script_args,
                "nnodes": nnodes,
                "nproc_per_node": nproc,
                "join_timeout": join_timeout,
                "threads": commands.threads_per_process(cpu, nproc),
                "dist_backend": process_group,
                "rank0_only": rank0_only,
                "max_restarts": max_restarts,
            },
            path=path,
            ship_working_folder=ship_working_folder,
            collect=paths,
            start_timeout=start_timeout,
            echo=echo,
            check=check,
        )


def _pickled_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        import cloudpickle  # functions defined in a notebook travel by value
    except ImportError:
        raise ConfigError(f"run_torch(function) needs cloudpickle: {install_hint('pytorch', 'cloudpickle')}") from None
    try:
        return bytes(cloudpickle.dumps((fn, args, kwargs)))
    except Exception as e:
        raise ConfigError(f"run_torch({getattr(fn, '__name__', fn)!r}): it cannot be pickled ({e})") from None


class _Nodes:
    """One run while it goes: the nodes' replies, the ranks' output, and the job that fails as a whole.

    Keyed by worker: an elastic run's lost node is replaced by a new worker, with the same index in
    the job, whose node is started here too (take_in). `job` is set once the job is launched.
    """

    def __init__(self, session: Session, result: TorchResult):
        self.session = session
        self.job: Job
        self.result = result
        self.replies: queue.Queue[tuple[str, dict[str, Any] | BaseException]] = queue.Queue()
        self.started: set[str] = set()  # workers whose node was started
        self.running: set[str] = set()  # those whose reply has not come
        self.failed_ranks: list[tuple[str, dict[str, Any]]] = []  # (worker, its node's first failure), not yet named
        self.first_failed_at: float | None = None
        self.lock = threading.Lock()
        self.output: dict[int, deque[str]] = {}
        self.unsubscribe = session.subscribe(self._on_event)

    @property
    def failed(self) -> bool:
        return self.job.failed.is_set()

    @property
    def done(self) -> bool:
        """Every member's node answered, a lost one's replacement's too (started once the job has it)."""
        members = list(self.job.members)
        with self.lock:
            answered = self.started - self.running
        return len(members) == self.result.nnodes and all(m.worker_id in answered for m in members)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, OutputLine) and event.source in self.started:
            parsed = commands.parse_rank_line(event.text)
            if parsed is not None:
                self.output.setdefault(parsed[0], deque(maxlen=RESULT_LINES_KEPT)).append(parsed[1])

    def start(self, member: Member, plan: dict[str, Any]) -> None:
        worker_id = member.worker_id
        with self.lock:  # a replacement may come (take_in) while the first nodes start
            if worker_id in self.started:
                return
            self.started.add(worker_id)
            self.running.add(worker_id)

        def node() -> None:
            try:
                self.replies.put((worker_id, self.session.call(worker_id, f"{NODE}:run", plan)))
            except BaseException as e:  # its worker was stopped, or ended, or torch is missing there
                self.replies.put((worker_id, e))

        threading.Thread(target=node, name=f"cmlcluster-torch-node-{worker_id}", daemon=True).start()

    def wait(self, until: Callable[[], bool], deadline: float | None = None) -> None:
        """Take the nodes' replies until `until()` holds, or the deadline; short waits, so Ctrl-C gets through."""
        while not until() and (deadline is None or time.monotonic() < deadline):
            try:
                worker_id, reply = self.replies.get(timeout=0.1)
            except queue.Empty:
                self._name_failure_when_due()
                continue
            self.running.discard(worker_id)
            self._on_reply(worker_id, reply)
            self._name_failure_when_due()

    def _name_failure_when_due(self) -> None:
        """Once every node has answered, or FAILURE_WINDOW after the first failed rank: fail the job,
        naming the failure that started it (one not caused by a lost peer, then the earliest)."""
        if self.first_failed_at is None or self.failed:
            return
        if self.running and time.monotonic() - self.first_failed_at < FAILURE_WINDOW:
            return
        worker_id, first = min(
            self.failed_ranks, key=lambda wf: (bool(PEER_LOST.search(wf[1]["message"])), wf[1]["timestamp"])
        )
        member = self.job.member(worker_id)
        self.result.failure = RankFailure(
            rank=first["rank"],
            local_rank=first["local_rank"],
            node_rank=first["rank"] // self.result.nproc_per_node,  # torch's, in the round it failed
            host=member.address,
            exit_code=first["exit_code"],
            message=first["message"],
            traceback=first["traceback"],
        )
        self.job.fail(
            JobFailure(member, FAILED, first["exit_code"], str(self.result.failure), member.address, first["traceback"])
        )

    def _on_reply(self, worker_id: str, reply: dict[str, Any] | BaseException) -> None:
        member = self.job.member(worker_id)
        if isinstance(reply, BaseException):
            # Its worker failed: the job replaces it, or says how it failed, once the worker's status
            # arrives. Else the call itself failed (no torch there, say): its last line says why.
            if not self._lost(worker_id):
                reason = str(reply).strip().splitlines()[-1]
                self.job.fail(JobFailure(member, FAILED, None, reason, member.address))
            return
        self.result.node_exit_codes[member.index] = reply["exit_code"]
        if reply["exit_code"] == 0:
            if reply["value"]:  # only rank 0's node has one
                self.result.value = pickle.loads(reply["value"])  # noqa: S301  # this run's own rank 0 made it
            return
        if self.failed:
            return  # a consequence of the first failure
        first = reply["failures"][0] if reply["failures"] else None
        if first is None:
            if self.first_failed_at is None:  # else a failed rank named soon says more
                reason = reply["error"] or f"torchrun on node {member.index} exited with code {reply['exit_code']}"
                self.job.fail(JobFailure(member, FAILED, reply["exit_code"], reason, member.address))
            return
        self.failed_ranks.append((worker_id, first))
        if self.first_failed_at is None:
            self.first_failed_at = time.monotonic()

    def _lost(self, worker_id: str) -> bool:
        """Whether the job failed, or lost this worker (and replaces it), within LOST_WORKER_WAIT."""
        deadline = time.monotonic() + LOST_WORKER_WAIT
        while worker_id in self.job.worker_ids and time.monotonic() < deadline:
            if self.job.failed.wait(0.05):
                return True
        return self.failed or worker_id not in self.job.worker_ids


def _run_job(
    session: Session,
    *,
    nnodes: int,
    nproc: int,
    resources: Resources,
    env: dict[str, str],
    plan: dict[str, Any],
    path: str,
    ship_working_folder: bool,
    collect: tuple[str, ...],
    start_timeout: float,
    echo: bool,
    check: bool,
) -> TorchResult:
    shipment = session.ship([path] if path else [], working_folder=ship_working_folder)
    plan = {**plan, "script": shipment.names.get(path, "")}
    result = TorchResult(exit_code=-1, nnodes=nnodes, nproc_per_node=nproc, hosts=[], master="", duration=0)
    run = _Nodes(session, result)

    def take_in(lost: Member, new: Member) -> None:  # on the job's thread: a lost node's replacement
        elastic = plan  # once the session's store runs, the plan names it
        if "endpoint" not in elastic:
            raise CmlClusterError("the run was still starting")
        send_files(session, [new.worker_id], shipment)
        run.start(new, {**elastic, "local_addr": new.address})

    restarts = Restarts(plan["max_restarts"], take_in, timeout_seconds=start_timeout) if plan["max_restarts"] else None
    role = Role("node", nnodes, resources, env=env, replaceable=restarts is not None, collect=collect)
    try:
        job = run.job = launch_job(session, [role], "PyTorch job", timeout_seconds=start_timeout, restarts=restarts)
    except BaseException:
        run.unsubscribe()
        raise
    result.hosts = [m.address for m in job.members]
    started_at = time.monotonic()
    store: SessionStore | None = None
    try:
        send_files(session, job.worker_ids, shipment)
        if restarts is not None:
            # Where workers reach the session (known once its first workers run): no worker's loss ends it.
            store = SessionStore(session.controller_ip)
            result.master = store.endpoint
            # The run id (128 random bits) and the key that signs the rendezvous state travel in the plan,
            # over the encrypted control plane, to each node's environment (node.py): never a command line.
            plan = {
                **plan,
                "endpoint": store.endpoint,
                "run_id": f"cmlcluster-{secrets.token_hex(16)}",
                "rdzv_key": secrets.token_hex(32),
            }
            for member in list(job.members):  # a replacement that came meanwhile is started once
                run.start(member, {**plan, "local_addr": member.address})
        else:
            master = job.members[0]
            port = session.call(master.worker_id, "cmlcluster.ports:free_ports", 1)[0]
            result.master = f"{master.address}:{port}"
            plan = {**plan, "master_addr": master.address, "master_port": port}
            for member in job.members:  # nodes but 0 wait for its rendezvous before joining (launch.py)
                run.start(member, {**plan, "node_rank": member.index})
        run.wait(until=lambda: run.done or run.failed)
        if run.failed:
            # The job stopped the other workers; their replies (errors, mostly) say nothing more.
            run.wait(until=lambda: not run.running, deadline=time.monotonic() + STOPPED_NODES_WAIT)
        result.worker_failure = job.failure if result.failure is None else None
        result.exit_code = 1 if run.failed or any(result.node_exit_codes.values()) else 0
    except KeyboardInterrupt:
        log.warning("cmlcluster: interrupted; the PyTorch job's workers and every process they ran were stopped")
        raise
    finally:
        job.stop()
        result.restarts = job.restarts
        result.hosts = [m.address for m in sorted(job.members, key=lambda m: m.index)]
        if store is not None:
            store.close()
        session.drain()  # the ranks' last lines are shown before what follows
        run.unsubscribe()
        result.output = {rank: list(lines) for rank, lines in sorted(run.output.items())}
    result.duration = time.monotonic() - started_at
    if echo:
        report_end(session, "torchrun", result)
    if check and not result.ok:
        raise TorchError(result)
    return result
