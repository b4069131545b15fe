"""One run, whatever the framework: the session it runs in, the files it sends, the job of its workers,
the end it reports and what it returns.

    run(options, framework)

takes a session (options.session; a session of its own on options.backend, closed at the end; or
the default one), ships the framework's files, launches one job of `framework.nnodes` workers with
options' resources (replacing lost ones up to options.max_restarts, when the framework can take a new
node in), sends the files to them, lets the framework's rendezvous start, starts every node, waits
for the run's end (the first failure ends it), stops the job, and tells the session how it ended
(a RunEnded event, shown in the run's view). With options.check, a failed run raises the framework's
RunError. A framework supplies only what differs (runs/nodes.py: NodeFramework).

run_horovod and start_cluster share session_for and report_end (their workers are an SSH cluster
and a TensorFlow cluster, with lives of their own: kept for reuse, or serving until stopped).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from .. import api, blocking
from ..errors import CmlClusterError
from ..events import Member, RunEnded
from ..jobs import Restarts, Role, launch_job
from ..session import Session
from ..shipping import Shipment
from .nodes import NodeFramework, Nodes
from .result import NodesResult, RunResult

if TYPE_CHECKING:
    from ..backends import Backend
    from .options import WorkerOptions

R = TypeVar("R", bound=NodesResult)
STOPPED_NODES_WAIT = 10.0  # seconds to wait for the other nodes' calls to end once the run failed

log = logging.getLogger(__name__)


def run(options: WorkerOptions, framework: NodeFramework[R]) -> R:
    """Run `framework` on workers as `options` say; its result (see the module's docstring)."""
    with session_for(options.session, options.backend, options.echo, framework.title) as session:
        result = _run_job(session, options, framework)
    if options.check and not result.ok:
        raise framework.error(result)
    return result


def _run_job(session: Session, options: WorkerOptions, framework: NodeFramework[R]) -> R:
    shipment = session.ship(framework.files, working_folder=options.ship_working_folder)
    result = framework.new_result()
    nodes = Nodes(session, result, framework.node_function)
    plan = framework.plan(shipment)

    def take_in(lost: Member, new: Member) -> None:  # on the job's thread: a lost node's replacement
        if "endpoint" not in plan:  # once the rendezvous runs, the plan names it
            raise CmlClusterError("the run was still starting")
        send_files(session, [new.worker_id], shipment)
        nodes.start(new, framework.node_plan(plan, new))

    elastic = options.max_restarts > 0
    restarts = Restarts(options.max_restarts, take_in, timeout_seconds=options.start_timeout) if elastic else None
    role = Role(
        "node",
        framework.nnodes,
        options.resources,
        env=dict(options.env),
        replaceable=elastic,
        collect=options.collect,
    )
    try:
        job = nodes.job = launch_job(
            session, [role], framework.job_name, timeout_seconds=options.start_timeout, restarts=restarts
        )
    except BaseException:
        nodes.unsubscribe()
        raise
    started_at = time.monotonic()
    try:
        send_files(session, job.worker_ids, shipment)
        with framework.rendezvous(session, job, elastic) as where:
            result.master = where.pop("master")
            plan.update(where)
            for member in list(job.members):  # a replacement that came meanwhile is started once
                nodes.start(member, framework.node_plan(plan, member))
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
    if options.echo:
        report_end(session, framework.run_name, result)
    return result


@contextlib.contextmanager
def session_for(session: Session | None, backend: str | Backend | None, echo: bool, title: str) -> Iterator[Session]:
    """The session a run uses: the one given; else, for backend=, one of its own, closed when the run
    ends; else the default session (cmlcluster.get_session()). With echo, the run (`title`) shows
    here, in a view of its own. While the run holds the cell, the widget's Stop ends it (cmlcluster.blocking)."""
    owned = session is None and backend is not None
    if session is None:
        session = Session(backend, echo=echo) if backend is not None else api.get_session()
    try:
        with session.showing(title) if echo else contextlib.nullcontext(), blocking.blocking(session):
            yield session
    finally:
        if owned:
            session.close()


def send_files(session: Session, worker_ids: Sequence[str], shipment: Shipment) -> None:
    """Unpack a shipment in these workers (nothing to do when they see the files already)."""
    if shipment.files:
        session.call_each(
            [(w, "cmlcluster.agent.main:unpack_files", (shipment.files, shipment.in_cwd)) for w in worker_ids]
        )


def report_end(session: Session, run: str, result: RunResult) -> None:
    """Tell the session's view how the run ended, and let it show that before the call returns."""
    session.publish(RunEnded(run, result.ok, result.message))
    session.drain()
