"""Where a bench's time goes: one call's phases, in seconds from its start, ours beside by hand.

Ours is read off the session's own events (follow() subscribes before the call), so it costs the
call nothing it would not do anyway; a by-hand side marks its own phases. A phase reached by several
workers is marked when the last of them reaches it ("workers registered": every worker running).

    timeline = Timeline().follow(session)   # before the call
    ...                                     # the call
    timeline.mark("returned")
    print(timeline.format("ours"))
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable

from cmlcluster import Session
from cmlcluster.control.controller import LISTENING_FILE
from cmlcluster.events import Event, JobChanged, OutputLine, Progress, RunEnded, SessionClosed, WorkerStatus

ENDED = ("succeeded", "failed", "stopped")


class Timeline:
    def __init__(self) -> None:
        self.start = time.time()
        self.marks: dict[str, float] = {}  # phase -> seconds since start
        self._status: dict[str, str] = {}  # worker id -> its last status
        self._session: Session | None = None
        self._unsubscribe: Callable[[], None] = lambda: None
        self._lock = threading.Lock()

    def mark(self, phase: str, at: float | None = None, *, last: bool = False) -> None:
        """The phase reached now (or at `at`, a time.time()); the first time, or with last= the latest."""
        seconds = (time.time() if at is None else at) - self.start
        with self._lock:
            if last or phase not in self.marks:
                self.marks[phase] = seconds

    def follow(self, session: Session) -> Timeline:
        self._session = session
        self._unsubscribe = session.subscribe(self._on_event)
        return self

    def stop_following(self) -> None:
        """For a session that goes on to other calls: its later events are not this call's."""
        self._unsubscribe()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, WorkerStatus):
            worker = event.worker
            self._status[worker.id] = worker.status
            statuses = set(self._status.values())
            if worker.status == "scheduling":
                self.mark("workers started", last=True)
            elif worker.status == "running":
                self._controller_listening()
                if statuses <= {"running", *ENDED}:
                    self.mark("workers registered", last=True)
            elif worker.status in ENDED:
                self.mark("first worker ended")
                if statuses <= set(ENDED):
                    self.mark("workers ended", last=True)
        elif isinstance(event, JobChanged):
            self.mark(f"job {event.state}")
        elif isinstance(event, OutputLine):
            self.mark("first output")
        elif isinstance(event, Progress):
            self.mark("training", at=event.time)
        elif isinstance(event, RunEnded):
            self.mark("run ended")
        elif isinstance(event, SessionClosed):
            self.mark("session closed")

    def _controller_listening(self) -> None:
        # The controller's word that it listens is a file in the session's folder (removed with it).
        folder = self._session.session_dir if self._session is not None else None
        if folder and "controller listening" not in self.marks:
            try:
                listening = os.stat(os.path.join(folder, LISTENING_FILE)).st_mtime
            except OSError:
                return
            if listening >= self.start:  # not the controller of an earlier call of the session's
                self.mark("controller listening", at=listening)

    def phases(self) -> list[tuple[str, float]]:
        return sorted(self.marks.items(), key=lambda item: item[1])

    def format(self, title: str) -> str:
        lines, before = [f"  {title}:"], 0.0
        for phase, seconds in self.phases():
            lines.append(f"    {seconds:7.2f} s  (+{seconds - before:5.2f})  {phase}")
            before = seconds
        return "\n".join(lines)


def median_timeline(timelines: Iterable[Timeline]) -> Timeline:
    """Each phase's median over the runs that reached it: one timeline to print for several repeats."""
    runs = list(timelines)
    merged = Timeline()
    merged.start = 0.0
    for phase in {phase for t in runs for phase in t.marks}:
        merged.marks[phase] = statistics.median(t.marks[phase] for t in runs if phase in t.marks)
    return merged
