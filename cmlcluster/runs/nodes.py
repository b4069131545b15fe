"""A run of one node per worker, as the session drives it: what a framework supplies (NodeFramework),
the run itself (NodeFramework.execute) and the nodes while they run (Nodes).

Each node is a call on its worker (framework.node_function, with the node's plan) that runs the
framework's launcher there to its end, prints each process's lines as ``[rank r] text`` and replies
{"exit_code", "failures" (first first: rank, local_rank, exit_code, message, traceback, timestamp),
"error" (why the launcher did not run), "value" (rank 0's return value, pickled)}.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import pickle
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CmlClusterError, ConfigError, install_hint
from ..events import Event, JobFailure, Member, OutputLine
from ..jobs import Restarts, Role, launch_job
from ..workers import FAILED, user_file
from .result import RESULT_LINES_KEPT, NodesResult, RankFailure
from .skeleton import Framework, send_files

if TYPE_CHECKING:
    from ..jobs import Job
    from ..session import Session
    from ..shipping import Shipment
    from .options import WorkerOptions

R = TypeVar("R", bound=NodesResult)
LOST_WORKER_WAIT = 5.0  # seconds for a node's worker status to arrive after its call failed
# After a node reports a failed rank, how long the other nodes' failures may take to arrive before the
# run names one: a rank's death breaks its peers' collectives within moments, and the peer whose
# launcher ends first must not be named for a failure that only followed the real one.
FAILURE_WINDOW = 2.0
STOPPED_NODES_WAIT = 10.0  # seconds to wait for the other nodes' calls to end once the run failed
# The message of a rank that failed because a peer went away (Gloo's, NCCL's and gRPC's words for it).
PEER_LOST = re.compile(
    r"closed by peer|reset by peer|Broken pipe|Connection refused|NCCL communicator was aborted|UNAVAILABLE"
)
RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$", re.DOTALL)  # how a rank's line reaches the session

log = logging.getLogger(__name__)


def parse_rank_line(text: str) -> tuple[int, str] | None:
    """(rank, text) of a line as the session receives it, "[rank 3] text"; None for other lines."""
    match = RANK_LINE.match(text)
    return (int(match.group(1)), match.group(2)) if match else None


class NodeFramework(Framework[R]):
    """A framework of one node per worker: its names, its files, each node's plan, its rendezvous and its
    result. Everything else (shipping, the job, replacing lost workers, the nodes while they run) is
    execute's, the same for every such framework; the session and the end are run()'s.

    title, run_name: as every Framework's. job_name: the job's ("PyTorch job"). node_function:
    "module:function" that each worker calls with its plan. nnodes: workers, one node each. files: what
    the nodes need, shipped to workers that do not see it.
    """

    job_name: str
    node_function: str
    nnodes: int
    files: list[str]

    @abc.abstractmethod
    def new_result(self) -> R:
        """The result before the run: nothing done yet."""

    @abc.abstractmethod
    def plan(self, shipment: Shipment) -> dict[str, Any]:
        """What every node is given (the script as shipped, the framework's settings)."""

    def node_plan(self, plan: dict[str, Any], member: Member) -> dict[str, Any]:
        """One node's plan: its rank is its index in the job."""
        return {**plan, "node_rank": member.index}

    @contextlib.contextmanager
    def rendezvous(self, session: Session, job: Job, elastic: bool) -> Iterator[dict[str, Any]]:
        """Where the nodes meet, added to the plan, while the run goes, and "master" (address:port) for the
        result: by default a port free on node 0's worker, at its address (a static rendezvous)."""
        master = job.members[0]
        port = session.call(master.worker_id, "cmlcluster.ports:free_ports", 1)[0]
        yield {"master": f"{master.address}:{port}", "master_addr": master.address, "master_port": port}

    def execute(self, session: Session, options: WorkerOptions) -> R:
        """The skeleton's run of one node per worker: ship, launch the job, send files, meet, start, wait, stop."""
        shipment = session.ship(self.files, working_folder=options.ship_working_folder)
        result = self.new_result()
        nodes = Nodes(session, result, self.node_function)
        plan = self.plan(shipment)

        def take_in(lost: Member, new: Member) -> None:  # on the job's thread: a lost node's replacement
            if "endpoint" not in plan:  # once the rendezvous runs, the plan names it
                raise CmlClusterError("the run was still starting")
            send_files(session, [new.worker_id], shipment)
            nodes.start(new, self.node_plan(plan, new))

        elastic = options.max_restarts > 0
        restarts = Restarts(options.max_restarts, take_in, timeout_seconds=options.start_timeout) if elastic else None
        role = Role(
            "node",
            self.nnodes,
            options.resources,
            env=dict(options.env),
            replaceable=elastic,
            collect=options.collect,
        )
        try:
            job = nodes.job = launch_job(
                session, [role], self.job_name, timeout_seconds=options.start_timeout, restarts=restarts
            )
        except BaseException:
            nodes.unsubscribe()
            raise
        started_at = time.monotonic()
        try:
            send_files(session, job.worker_ids, shipment)
            with self.rendezvous(session, job, elastic) as where:
                result.master = where.pop("master")
                plan.update(where)
                for member in list(job.members):  # a replacement that came meanwhile is started once
                    nodes.start(member, self.node_plan(plan, member))
                nodes.wait(until=lambda: nodes.done or nodes.failed)
                if nodes.failed:
                    # The job stopped the other workers; their replies (errors, mostly) say nothing more.
                    nodes.wait(until=lambda: not nodes.running, deadline=time.monotonic() + STOPPED_NODES_WAIT)
            result.worker_failure = job.failure if result.failure is None else None
            result.exit_code = 1 if nodes.failed or any(result.node_exit_codes.values()) else 0
        except KeyboardInterrupt:
            log.warning("cmlcluster: interrupted; the %s's workers and every process they ran were stopped", job.name)
            raise
        finally:
            job.stop()
            result.restarts = job.restarts
            result.hosts = [m.address for m in sorted(job.members, key=lambda m: m.index)]
            session.drain()  # the ranks' last lines are shown before what follows
            nodes.unsubscribe()
            result.output = nodes.ranks_output()
        result.duration = time.monotonic() - started_at
        return result


class Nodes:
    """One run while it goes: the nodes' replies, the ranks' output, and the job that fails as a whole.

    Keyed by worker: an elastic run's lost node is replaced by a new worker, with the same index in
    the job, whose node is started here too. `job` is set once the job is launched.
    """

    def __init__(self, session: Session, result: NodesResult, node_function: str):
        self.session = session
        self.node_function = node_function
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

    def ranks_output(self) -> dict[int, list[str]]:
        return {rank: list(lines) for rank, lines in sorted(self.output.items())}

    def _on_event(self, event: Event) -> None:
        if isinstance(event, OutputLine) and event.source in self.started:
            parsed = parse_rank_line(event.text)
            if parsed is not None:
                self.output.setdefault(parsed[0], deque(maxlen=RESULT_LINES_KEPT)).append(parsed[1])

    def start(self, member: Member, plan: dict[str, Any]) -> None:
        worker_id = member.worker_id
        with self.lock:  # a replacement may come while the first nodes start
            if worker_id in self.started:
                return
            self.started.add(worker_id)
            self.running.add(worker_id)

        def node() -> None:
            try:
                self.replies.put((worker_id, self.session.call(worker_id, self.node_function, plan)))
            except BaseException as e:  # its worker was stopped, or ended, or the framework is missing there
                self.replies.put((worker_id, e))

        threading.Thread(target=node, name=f"cmlcluster-node-{worker_id}", daemon=True).start()

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
            node_rank=first["rank"] // self.result.nproc_per_node,  # the launcher's, in the round it failed
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
            # arrives. Else the call itself failed (no framework there, say): its last line says why.
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
                launcher = self.result.launcher
                reason = reply["error"] or f"{launcher} on node {member.index} exited with code {reply['exit_code']}"
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


def entry_of(
    script: str | Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None, caller: str
) -> tuple[bytes, str, list[str]]:
    """(a function's pickled call, a script's path, a script's arguments): one of the two is empty."""
    if callable(script):
        return pickled_call(script, tuple(args), dict(kwargs or {}), caller), "", []
    if kwargs:
        raise ConfigError("kwargs= is for a function; pass a script's options in args=[...]")
    if not isinstance(script, (str, os.PathLike)):
        raise ConfigError(f"script={script!r}: give the path of the training script, or a function")
    return b"", user_file(script), check_script_args(args)


def pickled_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], caller: str) -> bytes:
    """A function with its arguments, as a node sends it to its processes (cloudpickle: a function
    defined in a notebook travels by value)."""
    try:
        import cloudpickle
    except ImportError:
        raise ConfigError(f"{caller}(function) needs cloudpickle: {install_hint('pytorch', 'cloudpickle')}") from None
    try:
        return bytes(cloudpickle.dumps((fn, args, kwargs)))
    except Exception as e:
        raise ConfigError(f"{caller}({getattr(fn, '__name__', fn)!r}): it cannot be pickled ({e})") from None


def check_script_args(args: Any) -> list[str]:
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"args={args!r}: a script's arguments are a list of strings, e.g. ['--epochs', '3']")
    return list(args)
