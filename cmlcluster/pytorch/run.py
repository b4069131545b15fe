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
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import checks
from ..backends import Backend
from ..errors import ConfigError
from ..events import Event, OutputLine
from ..jobs import Job, JobFailure, Role, launch_job
from ..runs import RESULT_LINES_KEPT, RunError, RunResult, report_end, send_files, session_for
from ..session import Session
from ..workers import FAILED, Resources, check_env
from . import commands

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


@dataclass(frozen=True)
class RankFailure:
    """The process that failed first: its global and local rank, node, exit code, and why."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    exit_code: int
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        where = f"local rank {self.local_rank} on node {self.node_rank}, {self.host}"
        return f"rank {self.rank} ({where}) exited with code {self.exit_code}: {self.message}"


@dataclass
class TorchResult(RunResult):
    """What a PyTorch run did: its exit code, every rank's output, which rank failed and why."""

    exit_code: int
    nnodes: int
    nproc_per_node: int
    hosts: list[str]  # each node's address, node 0 first
    master: str  # the rendezvous endpoint, address:port
    duration: float  # seconds from the workers running to the end of the run
    output: dict[int, list[str]] = field(default_factory=dict)  # rank -> its last lines
    node_exit_codes: dict[int, int] = field(default_factory=dict)  # node rank -> torchrun's exit code
    failure: RankFailure | None = None
    worker_failure: JobFailure | None = None  # a worker that ended during the run (killed, crashed)
    value: Any = None  # rank 0's return value, for a function

    @property
    def failed_rank(self) -> int | None:
        return self.failure.rank if self.failure is not None else None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def __repr__(self) -> str:
        state = "ok" if self.ok else "failed" + (f" (rank {self.failed_rank})" if self.failure else "")
        return (
            f"<TorchResult {state} exit_code={self.exit_code} ranks={self.world_size} nodes={self.nnodes} "
            f"{self.duration:.1f} s master={self.master}>"
        )

    @property
    def message(self) -> str:
        if self.ok:
            return f"torchrun succeeded: {self.world_size} processes on {self.nnodes} nodes"
        if self.failure is not None:
            details = self.failure.traceback.rstrip() or "\n".join(self.output.get(self.failure.rank, [])[-20:])
            return f"{self.failure}; every other process was stopped.\n{details}".rstrip()
        if self.worker_failure is not None:
            return f"the PyTorch job failed: {self.worker_failure}; every other worker was stopped"
        codes = ", ".join(f"node {n}: {c}" for n, c in sorted(self.node_exit_codes.items()))
        return f"the PyTorch job failed (torchrun exit codes: {codes or 'none'})"


class TorchError(RunError):
    """run_torch(check=True) failed; `result` is its TorchResult."""


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
    ship_working_folder: bool = False,
    echo: bool = True,
    check: bool = False,
) -> TorchResult:
    """Run `script args` (or `script(*args, **kwargs)` for a function) under torchrun on `nnodes` workers.

    nproc_per_node: processes per worker ("auto": its GPUs, or 1). dist_backend: what
    cmlcluster.pytorch.init_process_group() uses ("nccl" with GPUs, else "gloo"; its name is in
    CMLCLUSTER_DIST_BACKEND). join_timeout: seconds for every node to reach worker 0's
    rendezvous. rank0_only: stream only rank 0's output. A function's return value on rank 0
    comes back as result.value. check: raise TorchError instead of returning a failed result.
    Workers get env= and cmlcluster's own variables (docs/guide/workers.md, "What workers see").
    """
    # Everything is checked before anything starts.
    if not checks.whole(nnodes, 1):
        raise ConfigError(f"nnodes={nnodes!r}: give a whole number of workers, 1 or more")
    if not checks.whole(nvidia_gpu, 0):
        raise ConfigError(f"nvidia_gpu={nvidia_gpu!r}: give a whole number of GPUs per worker, 0 or more")
    nproc = commands.nproc_for(nproc_per_node, nvidia_gpu)
    process_group = commands.dist_backend_for(dist_backend, nvidia_gpu)
    for name, seconds in (("join_timeout", join_timeout), ("start_timeout", start_timeout)):
        if not checks.number(seconds, above=0):
            raise ConfigError(f"{name}={seconds!r}: give a number of seconds above 0")
    env = check_env(env)
    if callable(script):
        call = _pickled_call(script, tuple(args), dict(kwargs or {}))
        script_args: list[str] = []
        path = ""
    else:
        if kwargs:
            raise ConfigError("kwargs= is for a function; pass a script's options in args=[...]")
        if not isinstance(script, str) or not os.path.isfile(script):
            raise ConfigError(f"script={script!r}: no such file; give the path of the training script, or a function")
        call, path, script_args = b"", os.path.abspath(script), commands.check_script_args(args)

    with session_for(session, backend, echo) as session:
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
            },
            path=path,
            ship_working_folder=ship_working_folder,
            start_timeout=start_timeout,
            echo=echo,
            check=check,
        )


def _pickled_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        import cloudpickle  # functions defined in a notebook travel by value
    except ImportError:
        raise ConfigError("run_torch(function) needs cloudpickle: pip install 'cmlcluster[pytorch]'") from None
    try:
        return bytes(cloudpickle.dumps((fn, args, kwargs)))
    except Exception as e:
        raise ConfigError(f"run_torch({getattr(fn, '__name__', fn)!r}): it cannot be pickled ({e})") from None


class _Nodes:
    """One run while it goes: the nodes' replies, the ranks' output, and the job that fails as a whole."""

    def __init__(self, session: Session, job: Job, result: TorchResult):
        self.session = session
        self.job = job
        self.result = result
        self.replies: queue.Queue[tuple[int, dict[str, Any] | BaseException]] = queue.Queue()
        self.running: set[int] = set()  # nodes whose reply has not come
        self.failed_ranks: list[tuple[int, dict[str, Any]]] = []  # (node, its first failure), not yet named
        self.first_failed_at: float | None = None
        self.nodes = {m.worker_id: i for i, m in enumerate(job.members)}
        self.output: dict[int, deque[str]] = {}
        self.unsubscribe = session.subscribe(self._on_event)

    @property
    def failed(self) -> bool:
        return self.job.failed.is_set()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, OutputLine) and event.source in self.nodes:
            parsed = commands.parse_rank_line(event.text)
            if parsed is not None:
                self.output.setdefault(parsed[0], deque(maxlen=RESULT_LINES_KEPT)).append(parsed[1])

    def start(self, node_rank: int, plan: dict[str, Any]) -> None:
        worker_id = self.job.members[node_rank].worker_id
        self.running.add(node_rank)

        def node() -> None:
            try:
                self.replies.put((node_rank, self.session.call(worker_id, f"{NODE}:run", plan)))
            except BaseException as e:  # its worker was stopped, or ended, or torch is missing there
                self.replies.put((node_rank, e))

        threading.Thread(target=node, name=f"cmlcluster-torch-node-{node_rank}", daemon=True).start()

    def wait(self, until: Callable[[], bool], deadline: float | None = None) -> None:
        """Take the nodes' replies until `until()` holds, or the deadline; short waits, so Ctrl-C gets through."""
        while not until() and (deadline is None or time.monotonic() < deadline):
            try:
                node_rank, reply = self.replies.get(timeout=0.1)
            except queue.Empty:
                self._name_failure_when_due()
                continue
            self.running.discard(node_rank)
            self._on_reply(node_rank, reply)
            self._name_failure_when_due()

    def _name_failure_when_due(self) -> None:
        """Once every node has answered, or FAILURE_WINDOW after the first failed rank: fail the job,
        naming the failure that started it (one not caused by a lost peer, then the earliest)."""
        if self.first_failed_at is None or self.failed:
            return
        if self.running and time.monotonic() - self.first_failed_at < FAILURE_WINDOW:
            return
        node_rank, first = min(
            self.failed_ranks, key=lambda nf: (bool(PEER_LOST.search(nf[1]["message"])), nf[1]["timestamp"])
        )
        member = self.job.members[node_rank]
        self.result.failure = RankFailure(
            rank=first["rank"],
            local_rank=first["local_rank"],
            node_rank=node_rank,
            host=member.address,
            exit_code=first["exit_code"],
            message=first["message"],
            traceback=first["traceback"],
        )
        self.job.fail(
            JobFailure(member, FAILED, first["exit_code"], str(self.result.failure), member.address, first["traceback"])
        )

    def _on_reply(self, node_rank: int, reply: dict[str, Any] | BaseException) -> None:
        member = self.job.members[node_rank]
        if isinstance(reply, BaseException):
            # Its worker failed: the job says how, once the worker's status arrives. Else the call
            # itself failed (no torch there, say): its last line says why.
            if not self.job.failed.wait(LOST_WORKER_WAIT):
                reason = str(reply).strip().splitlines()[-1]
                self.job.fail(JobFailure(member, FAILED, None, reason, member.address))
            return
        self.result.node_exit_codes[node_rank] = reply["exit_code"]
        if reply["exit_code"] == 0:
            if node_rank == 0 and reply["value"]:
                self.result.value = pickle.loads(reply["value"])  # noqa: S301  # this run's own rank 0 made it
            return
        if self.failed:
            return  # a consequence of the first failure
        first = reply["failures"][0] if reply["failures"] else None
        if first is None:
            if self.first_failed_at is None:  # else a failed rank named soon says more
                reason = reply["error"] or f"torchrun on node {node_rank} exited with code {reply['exit_code']}"
                self.job.fail(JobFailure(member, FAILED, reply["exit_code"], reason, member.address))
            return
        self.failed_ranks.append((node_rank, first))
        if self.first_failed_at is None:
            self.first_failed_at = time.monotonic()


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
    start_timeout: float,
    echo: bool,
    check: bool,
) -> TorchResult:
    shipment = session.ship([path] if path else [], working_folder=ship_working_folder)
    job = launch_job(session, [Role("node", nnodes, resources, env=env)], "PyTorch job", timeout_seconds=start_timeout)
    result = TorchResult(
        exit_code=-1, nnodes=nnodes, nproc_per_node=nproc, hosts=[m.address for m in job.members], master="", duration=0
    )
    started_at = time.monotonic()
    run: _Nodes | None = None
    try:
        send_files(session, job.worker_ids, shipment)
        master = job.members[0]
        port = session.call(master.worker_id, "cmlcluster.ports:free_ports", 1)[0]
        result.master = f"{master.address}:{port}"
        plan = {**plan, "script": shipment.names.get(path, ""), "master_addr": master.address, "master_port": port}
        run = _Nodes(session, job, result)
        for node_rank in range(nnodes):  # nodes but 0 wait for its rendezvous before joining (launch.py)
            run.start(node_rank, {**plan, "node_rank": node_rank})
        run.wait(until=lambda: not run.running or run.failed)
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
        if run is not None:
            session.drain()  # the ranks' last lines are shown before what follows
            run.unsubscribe()
            result.output = {rank: list(lines) for rank, lines in sorted(run.output.items())}
    result.duration = time.monotonic() - started_at
    if echo:
        report_end(session, "torchrun", result)
    if check and not result.ok:
        raise TorchError(result)
    return result
