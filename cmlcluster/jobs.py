"""A job: a group of a session's workers that stand or fall together.

A TensorFlow cluster's tasks, or the hosts of a Horovod run, wait on each other:
when one of them fails while the job runs (it was killed, it crashed, its
program raised), the others would wait for it until a framework timeout, if
ever. A Job watches its members through the session's events; the first member
to fail fails the job, with a structured JobFailure, and every other member is
stopped at once. A member *stopped* on request does not fail the job: stopping
a cluster's workers with stop_workers() is how a user ends it. The framework that owns the job raises the failure where
the user waits.

A job run with Restarts (max_restarts=N, opt-in) replaces a lost member of a role
marked replaceable instead: a new worker with the role's resources is launched,
the framework brings it into the run (Restarts.replace), and the job goes on.
Only when the restarts are used up, or a replacement cannot start, does the job
fail as above. This is the one place that decides what a lost member means.

launch_job() is the one way frameworks get their workers: launch every role's
workers, wait until they run, go on with fewer where a role allows it, and
refuse with every reason at once where it does not.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import CmlClusterError, WorkerError
from .events import JobChanged, JobFailure, JobState, Member, WorkerStatus
from .workers import FAILED, TAIL_LINES, Resources, WorkerSnapshot

if TYPE_CHECKING:
    from .events import Event
    from .session import Session

log = logging.getLogger(__name__)

# A failed job's other members get this long between TERM and KILL: their peer is gone, and a
# program blocked in user code (a training step, a wait on the dead peer) would use all of it.
FAILED_JOB_STOP_GRACE = 1.0


class JobStartFailed(CmlClusterError):
    """Too few of a job's workers started; every one that did was stopped."""

    def __init__(self, message: str, failures: Sequence[JobFailure]):
        super().__init__(message)
        self.failures = list(failures)


@dataclass(frozen=True)
class Role:
    """`count` workers with these resources; the job goes on with at least `min_count` of them."""

    name: str
    count: int
    resources: Resources
    min_count: int | None = None  # None: all of them
    env: Mapping[str, str] = field(default_factory=dict)
    replaceable: bool = False  # a lost member can be replaced (TensorFlow's ps cannot: its variables go with it)
    collect: tuple[str, ...] = ()  # paths of its workers' folders that come home when each ends (collect/paths.py)

    def launch(self, session: Session, n: int, **more: Any) -> list[dict[str, Any]]:
        """Launch n workers of this role (`more`: launch_workers' other keywords); their dicts."""
        r = self.resources
        return session.launch_workers(n, r.cpu, r.memory, r.nvidia_gpu, env=self.env, collect=self.collect, **more)


@dataclass(frozen=True)
class Restarts:
    """Replace a lost member of a replaceable role, up to max_restarts times in all (torchrun's name).

    replace(lost, new) brings the new worker into the run (starts its server, its node); it runs on
    a thread of the job's, and raising refuses the replacement, which fails the job. same_address:
    the framework takes a member back only at the lost one's address (TensorFlow's tasks).
    """

    max_restarts: int
    replace: Callable[[Member, Member], None]
    same_address: bool = False
    timeout_seconds: float = 120.0  # for the replacement to run


class JobFailed(WorkerError):
    """A member of a job ended while the job ran; every other member was stopped."""

    def __init__(self, job: str, failure: JobFailure, restarts: int = 0):
        after = f" after {restarts} restart{'s' * (restarts != 1)}" if restarts else ""
        super().__init__(
            f"{job} failed{after}: {failure}\nEvery other worker of the {job} was stopped.", failure.member.worker_id
        )
        self.failure = failure
        self.restarts = restarts


class Job:
    """Watches `members` of `session` from now until finish(); see the module's docstring."""

    def __init__(
        self,
        session: Session,
        members: Sequence[Member],
        name: str,
        on_failure: Callable[[JobFailure], None] | None = None,
        *,
        roles: Sequence[Role] = (),
        restarts: Restarts | None = None,
    ):
        """on_failure(failure) runs once, on an event thread, after the other members were told to stop.

        roles: what each member's role is, for its replacement; restarts: see Restarts."""
        self.session = session
        self._on_failure = on_failure
        self.name = name
        self.members = list(members)
        self._by_id = {m.worker_id: m for m in self.members}
        self._roles = {role.name: role for role in roles}
        self._restarts = restarts
        self.restarts = 0  # replacements begun: what max_restarts counts
        self._lost: set[str] = set()  # members replaced, or being replaced
        self._lock = threading.Lock()
        self.failure: JobFailure | None = None
        self.failed = threading.Event()
        self._finished = False
        self._unsubscribe = session.subscribe(self._on_event)
        session.publish(JobChanged(name, JobState.STARTED, tuple(self.members)))
        # A member may have ended before the job began watching.
        for worker in session.snapshots():
            if worker.id in self._by_id:
                self._check(worker)

    @property
    def worker_ids(self) -> list[str]:
        return [m.worker_id for m in self.members]

    def member(self, worker_id: str) -> Member:
        return self._by_id[worker_id]

    def _on_event(self, event: Event) -> None:
        if isinstance(event, WorkerStatus) and event.worker.id in self._by_id:
            self._check(event.worker)

    def _check(self, worker: WorkerSnapshot) -> None:
        if worker.status != FAILED or self.session.closed or self.failed.is_set():
            return  # succeeded or stopped on request: the job's owner decides what that means
        member = self._by_id[worker.id]
        failure = JobFailure.of(member, worker, _tail(self.session, member.worker_id))
        with self._lock:
            if member.worker_id in self._lost:
                return  # being replaced already: this is the same end, seen again
            replace = self._can_replace(member)
            if replace:
                self._lost.add(member.worker_id)
                self.members.remove(member)
                self.restarts += 1
                restart = self.restarts
        if not replace:
            self.fail(failure)
            return
        assert self._restarts is not None
        log.warning(
            "cmlcluster: %s of the %s was lost (%s); replacing it (restart %d of %d)",
            member,
            self.name,
            failure.reason,
            restart,
            self._restarts.max_restarts,
        )
        self.session.publish(JobChanged(self.name, JobState.MEMBER_LOST, (member,), (failure,), restarts=restart))
        threading.Thread(
            target=self._replace, args=(member, failure, restart), name=f"cmlcluster-replace-{member.worker_id}"
        ).start()

    def _can_replace(self, member: Member) -> bool:
        role = self._roles.get(member.role)
        return (
            self._restarts is not None
            and role is not None
            and role.replaceable
            and self.restarts < self._restarts.max_restarts
            and not self._finished
        )

    def _replace(self, lost: Member, failure: JobFailure, restart: int) -> None:
        """Launch a worker like `lost`, let the framework take it in, and make it the job's member."""
        assert self._restarts is not None
        role = self._roles[lost.role]
        new_id = ""
        joined = False
        try:
            [record] = role.launch(self.session, 1, replaces=lost.worker_id)
            new_id = record.get("id", "")
            if not new_id:
                raise CmlClusterError(record.get("message") or "it could not be launched")
            ready = self.session.wait_for(
                [new_id], wait_for_completion=False, timeout_seconds=self._restarts.timeout_seconds
            )
            if not ready.workers:
                [late] = ready.failures
                raise CmlClusterError(f"worker {new_id} did not start: {late.message or late.status}")
            up = ready.workers[0]
            new = Member(new_id, lost.role, lost.index, up.ip_address, up.hostname or "")
            if self._restarts.same_address and new.address != lost.address:
                raise CmlClusterError(f"worker {new_id} runs at {new.address}, not at the lost one's {lost.address}")
            with self._lock:
                if self._finished or self.failure is not None:
                    raise CmlClusterError("the job ended meanwhile")
                self.members.append(new)  # from now on a failure of the job stops it too
                self._by_id[new_id] = new
                joined = True
            self._restarts.replace(lost, new)
        except Exception as e:
            if new_id and not joined and not self.session.closed:
                self.session.stop_workers_soon(new_id)
            why = f"{failure.reason}; its replacement failed: {e}"
            self.fail(JobFailure(lost, failure.status, failure.exit_code, why, failure.host, failure.output_tail))
            return
        with self._lock:  # published under it: never after the job's "finished"
            if self._finished:
                return  # ended while the framework took it in: it is stopped with the others, unannounced
            self.session.publish(JobChanged(self.name, JobState.MEMBER_REPLACED, (lost, new), restarts=restart))
        log.warning("cmlcluster: %s replaced %s in the %s", new, lost, self.name)

    def fail(self, failure: JobFailure) -> None:
        """Fail the job (once) and stop every other member at once.

        Called when a member's worker fails, and by a framework that sees a member fail
        while its worker goes on (a torchrun whose process failed, say).
        """
        with self._lock:
            if self._finished or self.failure is not None:
                return
            self.failure = failure
            callback = self._on_failure  # taken under the lock: on_failure() then sees the failure and leaves it
        others = [m.worker_id for m in self.members if m != failure.member]
        log.warning("cmlcluster: the %s failed: %s; stopping its other %d workers", self.name, failure, len(others))
        self.session.stop_workers_soon(*others, grace=FAILED_JOB_STOP_GRACE)
        self.session.publish(
            JobChanged(self.name, JobState.FAILED, tuple(self.members), (failure,), restarts=self.restarts)
        )
        self.failed.set()
        if callback is not None:
            callback(failure)

    def on_failure(self, callback: Callable[[JobFailure], None]) -> None:
        """Call `callback(failure)` once when the job fails (at once if it already has)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._on_failure = callback  # _check calls it
        if failure is not None:
            callback(failure)

    def stop(self) -> None:
        """Finish the job and stop every member."""
        self.finish()
        if self.worker_ids and not self.session.closed:  # none named would stop every worker of the session
            self.session.stop_workers(*self.worker_ids)

    def error(self) -> JobFailed:
        """What raises where the user waits, once the job failed."""
        assert self.failure is not None
        return JobFailed(self.name, self.failure, self.restarts)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.error()

    def finish(self) -> None:
        """The job is over (done, or being stopped on purpose): members ending now do not fail it."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            failed = self.failure is not None
        self._unsubscribe()
        if not failed:
            self.session.publish(JobChanged(self.name, JobState.FINISHED, tuple(self.members), restarts=self.restarts))


def _tail(session: Session, worker_id: str) -> str:
    try:
        return "\n".join(session.output(worker_id).splitlines()[-TAIL_LINES:])
    except Exception:  # the session is closing
        return ""


def launch_job(
    session: Session,
    roles: Sequence[Role],
    name: str,
    *,
    timeout_seconds: float = 60,
    on_failure: Callable[[JobFailure], None] | None = None,
    restarts: Restarts | None = None,
) -> Job:
    """Launch every role's workers and wait until they run; return the Job of those that do.

    A role with fewer running workers than its min_count fails the launch: everything
    launched is stopped, and JobStartFailed lists every worker that did not start, and
    why. Workers that were not running in time, where the roles allow going on without
    them, are stopped, and a warning names them. Members are in launch order per role.
    """
    launched: list[tuple[Role, dict[str, Any]]] = []
    try:
        for role in roles:
            if role.count:
                records = role.launch(session, role.count)
                launched += [(role, r) for r in records]
        ready = session.wait_for([r for _, r in launched], wait_for_completion=False, timeout_seconds=timeout_seconds)
        up = {w.id: w for w in ready.workers}
        members: list[Member] = []
        failures: list[JobFailure] = []
        short: list[str] = []
        for role in roles:
            mine = [r for rl, r in launched if rl is role]
            running = [up[r["id"]] for r in mine if r.get("id") in up]
            for i, worker in enumerate(running):
                members.append(Member(worker.id, role.name, i, worker.ip_address, worker.hostname or ""))
            for i, record in enumerate(r for r in mine if r.get("id") not in up):
                failed: WorkerSnapshot | dict[str, Any] = next(
                    (f for f in ready.failures if f.id == record.get("id")), record
                )
                member = Member(record.get("id", ""), role.name, len(running) + i)
                failures.append(
                    JobFailure.of(member, failed, _tail(session, member.worker_id) if member.worker_id else "")
                )
            if role.min_count is None and len(running) < role.count:
                short.append(
                    f"{role.count - len(running)} of {role.count} {role.name} tasks did not start, "
                    "and it cannot go on without all of them"
                )
            elif role.min_count is not None and len(running) < role.min_count:
                short.append(
                    f"only {len(running)} of {role.count} {role.name} tasks started, fewer than {role.min_count}"
                )
        reasons = "\n".join(f"  {f.member.role} {f.member.worker_id or '(not launched)'}: {f.reason}" for f in failures)
        if short:
            raise JobStartFailed(f"the {name} could not start: {'; '.join(short)}:\n{reasons}", failures)
        late = [f.member.worker_id for f in failures if f.member.worker_id]
        if late:
            session.stop_workers(*late)  # still starting, perhaps; the job goes on without them
        if failures:
            warnings.warn(
                f"the {name} goes on with {len(members)} of {len(launched)} workers; these did not start "
                f"and were stopped:\n{reasons}",
                stacklevel=3,
            )
        return Job(session, members, name, on_failure, roles=roles, restarts=restarts)
    except BaseException:
        started = [r["id"] for _, r in launched if "id" in r]
        # Only what this launch started: stop_workers() with no ids would stop every worker of the
        # session (a run_torch refused for its GPUs would take the user's other workers with it).
        if started and not session.closed:
            session.stop_workers(*started)
        raise
