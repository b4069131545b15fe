"""A job: a group of a session's workers that stand or fall together.

A TensorFlow cluster's tasks, or the hosts of a Horovod run, wait on each other:
when one of them fails while the job runs (it was killed, it crashed, its
program raised), the others would wait for it until a framework timeout, if
ever. A Job watches its members through the session's events; the first member
to fail fails the job, with a structured JobFailure, and every other member is
stopped at once. A member *stopped* on request does not fail the job: stopping
a cluster's workers with stop_workers() is how a user ends it. The framework that owns the job raises the failure where
the user waits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import WorkerError
from .workers import FAILED

if TYPE_CHECKING:
    from .session import Event, Session

log = logging.getLogger("cmlcluster")

# A failed job's other members get this long between TERM and KILL: their peer is gone, and a
# program blocked in user code (a training step, a wait on the dead peer) would use all of it.
FAILED_JOB_STOP_GRACE = 1.0


@dataclass(frozen=True)
class Member:
    """One worker of a job, and what it is there: a role ("ps", "worker", "host") and its index."""

    worker_id: str
    role: str
    index: int

    def __str__(self) -> str:
        return f"{self.role} task {self.index} (worker {self.worker_id})"


@dataclass(frozen=True)
class JobFailure:
    """The member whose end failed the job, with its status, exit code and the session's reason."""

    member: Member
    status: str
    exit_code: int | None
    reason: str

    def __str__(self) -> str:
        code = "" if self.exit_code is None else f" with exit code {self.exit_code}"
        return f"{self.member} {self.status}{code}: {self.reason}"


class JobFailed(WorkerError):
    """A member of a job ended while the job ran; every other member was stopped."""

    def __init__(self, job: str, failure: JobFailure):
        super().__init__(
            f"{job} failed: {failure}\nEvery other worker of the {job} was stopped.", failure.member.worker_id
        )
        self.failure = failure


class Job:
    """Watches `members` of `session` from now until finish(); see the module's docstring."""

    def __init__(
        self,
        session: Session,
        members: Sequence[Member],
        name: str,
        on_failure: Callable[[JobFailure], None] | None = None,
    ):
        """on_failure(failure) runs once, on the session's thread, after the other members were told to stop."""
        self.session = session
        self._on_failure = on_failure
        self.name = name
        self.members = list(members)
        self._by_id = {m.worker_id: m for m in self.members}
        self._lock = threading.Lock()
        self.failure: JobFailure | None = None
        self.failed = threading.Event()
        self._finished = False
        self._unsubscribe = session.subscribe(self._on_event)
        # A member may have ended before the job began watching.
        for record in session.list_workers():
            if record["id"] in self._by_id:
                self._check(record)

    @property
    def worker_ids(self) -> list[str]:
        return [m.worker_id for m in self.members]

    def member(self, worker_id: str) -> Member:
        return self._by_id[worker_id]

    def _on_event(self, event: Event) -> None:
        if event.kind == "status" and event.worker["id"] in self._by_id:
            self._check(event.worker)

    def _check(self, record: dict[str, Any]) -> None:
        if record["status"] != FAILED or self.session.closed:
            return  # succeeded or stopped on request: the job's owner decides what that means
        with self._lock:
            if self._finished or self.failure is not None:
                return
            member = self._by_id[record["id"]]
            reason = record.get("message") or ""
            self.failure = JobFailure(member, record["status"], record.get("exit_code"), reason)
        others = [m.worker_id for m in self.members if m is not member]
        log.warning(
            "cmlcluster: the %s failed: %s; stopping its other %d workers", self.name, self.failure, len(others)
        )
        self.session.stop_workers_soon(*others, grace=FAILED_JOB_STOP_GRACE)
        self.failed.set()
        if self._on_failure is not None:
            self._on_failure(self.failure)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise JobFailed(self.name, self.failure)

    def finish(self) -> None:
        """The job is over (done, or being stopped on purpose): members ending now do not fail it."""
        with self._lock:
            self._finished = True
        self._unsubscribe()
