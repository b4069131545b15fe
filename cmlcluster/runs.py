"""What every framework's run shares: the session it runs in, the files it sends, what it returns,
what it raises and how its end is told.

run_horovod and run_torch (and their magics) return a RunResult of their own kind
(HorovodResult, TorchResult), raise a RunError of their own kind with it, and tell the session
how they ended with a RunEnded event, which the session's view shows; nothing is printed
beside the event bus.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from . import api, blocking
from .errors import CmlClusterError
from .events import RunEnded
from .session import Session
from .shipping import Shipment

if TYPE_CHECKING:
    from .backends import Backend
    from .events import JobFailure

RESULT_LINES_KEPT = 10_000  # per rank, in a run's result (a run may print for hours)


class RunResult:
    """What a run did. Every kind has these; each adds what its framework knows (hosts, the master).

    exit_code: 0 when every rank succeeded. output: each rank's last lines. duration: seconds of
    the run. worker_failure: the worker that ended during the run (killed, crashed), if one did.
    failed_rank: the rank that failed first, when a rank did. message: what happened, in a sentence.
    """

    exit_code: int
    duration: float
    output: dict[int, list[str]]
    worker_failure: JobFailure | None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def message(self) -> str:
        raise NotImplementedError


class RunError(CmlClusterError):
    """A run failed (check=True): `result` says how."""

    def __init__(self, result: RunResult):
        super().__init__(result.message)
        self.result = result


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
