"""What a session tells its onlookers (a UI, a job, a log), and how it gets to them.

Events are small frozen records. A session publishes them from its loop thread; each
subscriber gets them in order on a thread of its own, so a slow or failing subscriber
never stalls the session: publishing only appends to a queue. When a subscriber falls
far behind, output lines, progress reports and resource samples (the events that come in
floods) are dropped for it, the oldest first: the end of a flood (a traceback, the last loss) is
what a user needs to see. It is told how many lines with a LinesDropped event where they were
missed, and a later report or sample supersedes a dropped one. Every other event is kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .workers import FAILED, Status, Text, WorkerSnapshot

log = logging.getLogger(__name__)

MAX_BACKLOG = 10_000  # events queued for one subscriber before its output lines are dropped


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"


@dataclass(frozen=True)
class WorkerStatus(Event):
    """A worker after a change of status (its snapshot; CML's dict is worker.to_dict())."""

    kind: ClassVar[str] = "status"
    worker: WorkerSnapshot


@dataclass(frozen=True)
class OutputLine(Event):
    """One line a worker (or a Horovod rank, or horovodrun) printed."""

    kind: ClassVar[str] = "output"
    source: str  # a worker id, "rank 3", "horovodrun"
    stream: str  # "stdout" | "stderr"
    text: str


@dataclass(frozen=True)
class LaunchFailed(Event):
    """A worker that could not be launched (CML's dict without an id)."""

    kind: ClassVar[str] = "launch_failed"
    message: str


@dataclass(frozen=True)
class Member:
    """One worker of a job, and what it is there: a role ("ps", "worker", "host") and its index."""

    worker_id: str
    role: str
    index: int
    address: str = ""  # the worker's IP, once it runs
    hostname: str = ""

    def __str__(self) -> str:
        return f"{self.role} task {self.index} (worker {self.worker_id})"


@dataclass(frozen=True)
class JobFailure:
    """A member that failed, or never started, with what a UI shows without parsing text."""

    member: Member
    status: Status
    exit_code: int | None
    reason: str
    host: str = ""  # where it ran (its address), "" when it never ran
    output_tail: str = ""  # its last lines of output

    def __str__(self) -> str:
        code = "" if self.exit_code is None else f" with exit code {self.exit_code}"
        return f"{self.member} {self.status}{code}: {self.reason}"

    @classmethod
    def of(cls, member: Member, record: Mapping[str, Any] | WorkerSnapshot, tail: str = "") -> JobFailure:
        """The failure of a member whose worker ended so (its snapshot, or a CML dict of await_workers')."""
        if isinstance(record, WorkerSnapshot):
            record = record.to_dict()
        address = record.get("ip_address") or ""
        return cls(
            member,
            Status(record.get("status", FAILED)),
            record.get("exit_code"),
            record.get("message") or record.get("status", ""),
            host="" if address == "unknown" else address,
            output_tail=tail,
        )


class JobState(Text):
    """What happened to a job (JobChanged.state)."""

    STARTED = "started"
    MEMBER_LOST = "member_lost"
    MEMBER_REPLACED = "member_replaced"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class JobChanged(Event):
    """A job (a TensorFlow cluster, a Horovod run) started, lost a member, replaced it, finished or failed."""

    kind: ClassVar[str] = "job"
    job: str  # its name: "TensorFlow cluster", "Horovod run"
    state: JobState
    # One per worker (role and index); MEMBER_LOST: the lost one; MEMBER_REPLACED: (lost, new)
    members: tuple[Member, ...] = ()
    failures: tuple[JobFailure, ...] = ()  # when it failed or lost a member
    restarts: int = 0  # members replaced so far (jobs.Restarts)

    def notes(self) -> list[str]:
        """What a view says of it, beside its rows: a failure, a lost member and its replacement."""
        if self.state == JobState.FAILED:
            return [f"{self.job} failed: {failure}" for failure in self.failures]
        if self.state == JobState.MEMBER_LOST:
            return [f"{self.job}: lost {failure}; replacing it (restart {self.restarts})" for failure in self.failures]
        if self.state == JobState.MEMBER_REPLACED:
            lost, new = self.members
            return [f"{self.job}: worker {new.worker_id} replaced worker {lost.worker_id} as {lost.role} {lost.index}"]
        return []


@dataclass(frozen=True)
class RunEnded(Event):
    """A framework's run (horovodrun, torchrun) ended; `message` says how (runs.RunResult.message)."""

    run: str
    ok: bool
    message: str


@dataclass(frozen=True)
class Progress(Event):
    """A training step reported by cmlcluster.report() (or the Keras callback)."""

    kind: ClassVar[str] = "progress"
    task: str  # "worker 0", "rank 1", "coordinator", or a worker id
    step: float
    total: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    worker: str | None = None  # the worker whose output carried it; None for the session's own reports


@dataclass(frozen=True)
class Straggler(Event):
    """A reporter of progress whose steps come more than `fraction` slower than its peers' median over
    `window` seconds (stragglers.py); `over` once it has caught up again. The views add what its
    worker uses (its latest ResourceUse)."""

    kind: ClassVar[str] = "straggler"
    task: str  # "rank 2"
    worker: str | None
    rate: float  # its steps a second over the window
    median: float  # its peers' median
    peers: str  # "rank": what its peers are
    fraction: float
    window: float
    over: bool = False

    def message(self, use: ResourceUse | None = None) -> str:
        if self.over:
            return f"{self.task} keeps pace again: {self.rate:.3g} steps/s, the {self.peers}s' median {self.median:.3g}"
        slower = 1 - self.rate / self.median if self.median else 1.0
        text = (
            f"{self.task} is a straggler: {slower:.0%} slower than the {self.peers}s' median "
            f"({self.rate:.3g} steps/s against {self.median:.3g}, over {self.window:g} s)"
        )
        if use is not None:
            gpus = "".join(f", GPU {g.index} {g.utilization_percent:.0f} % busy" for g in use.gpus)
            text += f"; its worker uses {use.cpu_percent:.0f} % CPU{gpus}"
        return text + "; the X-ray shows where it stands"


@dataclass(frozen=True)
class GpuUse:
    """One GPU of a worker, as NVML reports it."""

    index: int  # the GPU's index on its host (CUDA_VISIBLE_DEVICES numbers them)
    utilization_percent: float  # of its time busy, over NVML's last sample period
    memory_bytes: int  # in use
    memory_total_bytes: int


@dataclass(frozen=True)
class ResourceUse(Event):
    """What a worker uses now, sampled by its agent at a low rate: its whole process tree, the agent
    included (the program runs in it: code=, a script, a called function)."""

    kind: ClassVar[str] = "usage"
    worker_id: str
    cpu_percent: float  # of one core: 250.0 is two and a half cores busy
    memory_bytes: int  # resident, of the whole tree
    memory_limit_bytes: int | None  # what it may use (its cgroup's limit), None when unlimited or unknown
    gpus: tuple[GpuUse, ...] = ()
    time: float = field(default_factory=time.time)

    def fields(self) -> dict[str, Any]:
        """The sample as a record's (and list_workers') fields: plain JSON numbers."""
        return {
            "cpu_percent": round(self.cpu_percent, 1),
            "memory_bytes": self.memory_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "gpus": [
                {
                    "index": g.index,
                    "utilization_percent": g.utilization_percent,
                    "memory_bytes": g.memory_bytes,
                    "memory_total_bytes": g.memory_total_bytes,
                }
                for g in self.gpus
            ],
            "sampled_at": self.time,
        }


@dataclass(frozen=True)
class CallStarted(Event):
    """A call that starts or waits for work began (launch_workers, await_workers, run_cluster, a run):
    a view shows what follows (the workers it launches, the output and progress of its run) as its own.

    workers: the ids of the workers it is about (await_workers'), beside those it launches itself.
    """

    kind: ClassVar[str] = "call"
    call: str  # unique in the session
    title: str  # "launch_workers", "%torchrun train.py"
    workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class SessionClosed(Event):
    """The session closed: its workers are stopped; the last event a subscriber gets."""

    kind: ClassVar[str] = "closed"
    session: str  # its id


@dataclass(frozen=True)
class LinesDropped(Event):
    """This subscriber fell behind and missed `count` output lines."""

    kind: ClassVar[str] = "lines_dropped"
    count: int


Subscriber = Callable[[Event], None]
# What comes in floods: dropped, the oldest first, for a subscriber MAX_BACKLOG events behind.
_FLOODS = (OutputLine, Progress, ResourceUse)


class _Subscription:
    """One subscriber's queue and the thread that feeds it."""

    def __init__(self, callback: Subscriber, name: str, after_batch: Callable[[], None] | None = None):
        self.callback = callback
        self.after_batch = after_batch
        self._queue: deque[Event | None] = deque()
        self._ready = threading.Condition()
        self._published = 0
        self._handled = 0
        self._dropped = 0
        self.thread = threading.Thread(target=self._deliver, name=name, daemon=True)
        self.thread.start()

    def put(self, event: Event | None) -> None:
        with self._ready:
            if len(self._queue) >= MAX_BACKLOG and isinstance(event, _FLOODS) and self._drop_oldest_flood():
                self._published -= 1  # it will never be handled
            self._queue.append(event)
            self._published += 1
            self._ready.notify()

    def _drop_oldest_flood(self) -> bool:
        """Drop the oldest queued line, report or sample (the queue's first, in a flood); False if there is
        none (the backlog is of events that are all kept). Under the lock."""
        for index, queued in enumerate(self._queue):
            if isinstance(queued, _FLOODS):
                del self._queue[index]
                self._dropped += isinstance(queued, OutputLine)
                return True
        return False

    def wait_handled(self, deadline: float) -> None:
        """Wait until what was queued before this call has been handled, or the deadline."""
        with self._ready:
            target = self._published
            while self._handled < target and self.thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._ready.wait(remaining)

    def _deliver(self) -> None:
        while True:
            # Everything queued at once: one lock round per batch, not per event (floods come in batches).
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                batch = list(self._queue)
                self._queue.clear()
                if self._dropped:  # where they were missed: before what is left of the flood
                    first = next((i for i, e in enumerate(batch) if isinstance(e, _FLOODS)), len(batch))
                    batch.insert(min(first, len(batch) - (batch[-1] is None)), LinesDropped(self._dropped))
                    self._published += 1
                    self._dropped = 0
            for event in batch:
                if event is None:
                    break
                try:
                    self.callback(event)
                except Exception:
                    log.exception("cmlcluster: a subscriber (%r) failed on %s", self.callback, event)
            if self.after_batch is not None:
                try:
                    self.after_batch()
                except Exception:
                    log.exception("cmlcluster: a subscriber's after_batch (%r) failed", self.after_batch)
            with self._ready:
                self._handled += len(batch)
                self._ready.notify_all()
            if None in batch:
                return


class EventBus:
    """Fan-out of a session's events to its subscribers, a delivery thread each."""

    def __init__(self, name: str):
        self._name = name
        self._subscriptions: list[_Subscription] = []
        self._lock = threading.Lock()
        self._closed = False

    def subscribe(self, callback: Subscriber, after_batch: Callable[[], None] | None = None) -> Callable[[], None]:
        """Deliver every event from now on to `callback`, and call `after_batch()` (if given) after each run
        of events delivered together, before they count as handled; returns the function that ends that."""
        with self._lock:
            if self._closed:
                return lambda: None  # nothing will ever be published again
            name = f"{self._name}-events-{len(self._subscriptions)}"
            subscription = _Subscription(callback, name, after_batch)
            self._subscriptions.append(subscription)

        def unsubscribe() -> None:
            with self._lock:
                if subscription not in self._subscriptions:
                    return
                self._subscriptions.remove(subscription)
            subscription.put(None)  # what was queued before is still delivered

        return unsubscribe

    def publish(self, event: Event) -> None:
        """Queue `event` for every subscriber; never blocks on one. Any thread."""
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.put(event)

    def drain(self, timeout: float) -> None:
        """Wait (at most `timeout` s in all) until subscribers have handled what was published so far.

        The sync API calls this before returning, so that what a worker printed before
        await_workers returned is on screen by then. A subscriber calling back into the
        session from its delivery thread does not wait for itself.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            subscriptions = list(self._subscriptions)
        me = threading.current_thread()
        for subscription in subscriptions:
            if subscription.thread is not me:
                subscription.wait_handled(deadline)

    def close(self, timeout: float = 2.0) -> None:
        """Deliver what is queued (for at most `timeout` s), then end every delivery thread."""
        with self._lock:
            subscriptions, self._subscriptions = self._subscriptions, []
            self._closed = True
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for subscription in subscriptions:
            subscription.put(None)
        for subscription in subscriptions:
            if subscription.thread is not me:
                subscription.thread.join(max(0.0, deadline - time.monotonic()))
