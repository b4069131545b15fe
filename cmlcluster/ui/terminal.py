"""A session in a terminal: output lines, status changes and training progress.

With bars (tqdm, on a terminal), workers coming up and each task's training are
progress bars, and output lines are written above them. Without, everything is a
plain line, and progress is printed at most every PROGRESS_EVERY seconds a task.
Workers' output goes to the stream it was printed on; cmlcluster's own lines (statuses,
progress, jobs) go to stderr, so that a script's stdout stays its own.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any, TextIO

from ..events import (
    Event,
    JobChanged,
    LaunchFailed,
    LinesDropped,
    OutputLine,
    Progress,
    RunEnded,
    SessionClosed,
    WorkerStatus,
)
from ..progress import describe
from ..workers import FAILED, RUNNING

if TYPE_CHECKING:
    from ..session import Session

PROGRESS_EVERY = 2.0  # seconds between a task's progress lines, without bars


class TerminalView:
    """Subscribes to a session and writes what happens to stdout/stderr."""

    def __init__(self, session: Session, *, bars: bool = False):
        self._bars = bars
        self._lock = threading.Lock()
        self._labels: dict[str, str] = {}  # worker id -> "worker 0" once a job names it
        self._status: dict[str, str] = {}
        self._up: set[str] = set()  # workers that came up (ran), whatever happened since
        self._last_line: dict[str, float] = {}
        self._up_bar: Any = None
        self._task_bars: dict[str, Any] = {}
        session.subscribe(self)

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, OutputLine):
                self._write(f"[{self._labels.get(event.source, event.source)}] {event.text}", event.stream)
            elif isinstance(event, WorkerStatus):
                self._on_status(event.worker)
            elif isinstance(event, Progress):
                self._on_progress(event)
            elif isinstance(event, JobChanged):
                self._on_job(event)
            elif isinstance(event, LaunchFailed):
                self._write(f"[cmlcluster] {event.message}")
            elif isinstance(event, RunEnded) and not event.ok:
                self._write(f"[{event.run}] {event.message}")
            elif isinstance(event, LinesDropped):
                self._write(f"[cmlcluster] {event.count} output lines not shown (the display fell behind)")
            elif isinstance(event, SessionClosed):
                self._close_bars()

    def _write(self, line: str, stream: str = "stderr") -> None:
        """A line on stderr (cmlcluster's own: statuses, progress), or a worker's line on its stream."""
        out: TextIO = sys.stderr if stream == "stderr" else sys.stdout
        if self._bars and (self._up_bar is not None or self._task_bars):
            from tqdm import tqdm

            tqdm.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def _on_status(self, worker: dict[str, Any]) -> None:
        worker_id, status = worker["id"], worker["status"]
        before = self._status.get(worker_id)
        self._status[worker_id] = status
        if worker.get("running_at"):
            self._up.add(worker_id)
        if status == before:
            return
        name = self._labels.get(worker_id, worker_id)
        if status == RUNNING:
            where = worker.get("hostname") or ""
            detail = f" on {where} ({worker['ip_address']})" if where else f" at {worker['ip_address']}"
            self._line(f"[{name}] running{detail}")
        elif status == FAILED:
            self._write(f"[{name}] failed: {worker.get('message') or ''}".rstrip(": "))
        elif before is not None or status != "scheduling":
            self._line(f"[{name}] {status}")
        if self._bars and (status == "scheduling" or self._up_bar is not None):
            self._update_up_bar()  # while workers come up

    def _line(self, text: str) -> None:
        """A status line; with bars the workers bar tells it instead."""
        if not self._bars:
            self._write(text)

    def _update_up_bar(self) -> None:
        from tqdm import tqdm

        total = len(self._status)
        up = len(self._up)
        if self._up_bar is None:
            self._up_bar = tqdm(total=total, desc="workers up", unit="worker", leave=False, file=sys.stderr)
        self._up_bar.total = total
        self._up_bar.n = up
        self._up_bar.refresh()
        if "scheduling" not in self._status.values():  # every worker came up, or will not
            self._up_bar.close()
            self._up_bar = None
            self._write(f"[cmlcluster] {up} of {total} workers up")

    def _on_progress(self, progress: Progress) -> None:
        task = self._labels.get(progress.task, progress.task)
        if self._bars:
            self._progress_bar(task, progress)
            return
        now = time.monotonic()
        last_step = progress.total is not None and progress.step >= progress.total
        if last_step or now - self._last_line.get(task, 0.0) >= PROGRESS_EVERY:
            self._last_line[task] = now
            self._write(f"[{task}] {describe(progress)}")

    def _progress_bar(self, task: str, progress: Progress) -> None:
        from tqdm import tqdm

        total = None if progress.total is None else _whole(progress.total)
        bar = self._task_bars.get(task)
        if bar is None:
            bar = self._task_bars[task] = tqdm(total=total, desc=task, unit="step", file=sys.stderr)
        if total is not None:
            bar.total = total
        bar.n = _whole(progress.step)
        bar.set_postfix({k: f"{v:.4g}" for k, v in progress.metrics.items()}, refresh=False)
        bar.refresh()
        if progress.total is not None and progress.step >= progress.total:
            bar.close()
            del self._task_bars[task]

    def _on_job(self, event: JobChanged) -> None:
        if event.state in ("started", "member_replaced"):
            for member in event.members:
                self._labels[member.worker_id] = f"{member.role} {member.index}"
        if event.state == "started":
            self._write(f"[cmlcluster] {event.job} started: {len(event.members)} workers")
        elif event.state == "finished":
            self._close_bars()
            self._write(f"[cmlcluster] {event.job} finished")
        for note in event.notes():
            self._write(f"[cmlcluster] {note}")

    def _close_bars(self) -> None:
        for bar in [*self._task_bars.values(), *([self._up_bar] if self._up_bar is not None else [])]:
            bar.close()
        self._task_bars.clear()
        self._up_bar = None


def _whole(number: float) -> float | int:
    """5.0 as 5, so that a bar reads 5/20 steps."""
    return int(number) if float(number).is_integer() else number
