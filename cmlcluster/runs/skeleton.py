"""One run, whatever the framework: the session it runs in, the view it shows in, the end it reports
and what it returns.

    run(options, framework)

takes a session (options.session; a session of its own on options.backend, closed at the end; or the
default one), shows the run in its own view (options.echo), lets the framework run (Framework.execute:
its workers, its launcher, its result), tells the session how the run ended (a RunEnded event, shown in
the view) and, with options.check, raises the framework's RunError for a failed run.

Two kinds of framework execute on it: one node per worker, the skeleton's own job of nodes
(runs/nodes.py: NodeFramework; torchrun, JAX, Accelerate), and a launcher in the session that reaches its
workers itself (Horovod's horovodrun over SSH, horovod/run.py). A TensorFlow cluster is no run: it
outlives the call that starts it (tensorflow/cluster.py).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from .. import api, blocking
from ..events import RunEnded
from ..session import Session
from ..shipping import Shipment
from .result import RunError, RunResult

if TYPE_CHECKING:
    from ..backends import Backend
    from .options import WorkerOptions

R = TypeVar("R", bound=RunResult)


class Framework(abc.ABC, Generic[R]):
    """What a framework supplies to run(): its names, how it runs in a session, and what a failure raises.

    title: the run's view's title. run_name: the launcher, in the end's report ("torchrun").
    """

    title: str
    run_name: str

    @abc.abstractmethod
    def execute(self, session: Session, options: WorkerOptions) -> R:
        """Run in `session`, as `options` say: start the workers, run to the end, stop what was started."""

    @abc.abstractmethod
    def error(self, result: R) -> RunError:
        """What a failed run raises, with check=True."""


def run(options: WorkerOptions, framework: Framework[R]) -> R:
    """Run `framework` on workers as `options` say; its result (see the module's docstring)."""
    with session_for(options.session, options.backend, options.echo, framework.title) as session:
        result = framework.execute(session, options)
        if options.echo:
            report_end(session, framework.run_name, result)
    if options.check and not result.ok:
        raise framework.error(result)
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
