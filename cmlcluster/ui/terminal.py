"""A session in a terminal: output lines, status changes and training progress.

With bars (tqdm, on a terminal), workers coming up and each task's training are
progress bars, and output lines are written above them. Without, everything is a
plain line, and progress is printed at most every PROGRESS_EVERY seconds a task.
Workers' output goes to the stream it was printed on; cmlcluster's own lines (statuses,
progress, jobs) go to stderr, so that a script's stdout stays its own.

It draws the same model as the widget (model.py): the same labels, shown statuses, counts and
reasons, and framework INFO lines folded away (said once per source; the worker's log keeps them).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from ..events import (
    Event,
    JobChanged,
    JobState,
    LaunchFailed,
    LinesDropped,
    OutputLine,
    Progress,
    RunEnded,
    SessionClosed,
    Straggler,
    WorkerStatus,
)
from ..progress import describe
from ..viewers import ViewedSession
from ..workers import FAILED, RUNNING, STOPPED
from .model import SCHEDULING, Router, is_noise, reason

PROGRESS_EVERY = 2.0  # seconds between a task's progress lines, without bars


class TerminalView:
    """Subscribes to a session and writes what happens to stdout/stderr."""

    def __init__(self, session: ViewedSession, *, bars: bool = False):
        self._bars = bars
        self._lock = threading.Lock()
        self._router = Router(calls=False)  # one story: the whole session's
        self._model = self._router.whole
        self._said: dict[str, str] = {}  # worker id -> the status last said
        self._message_said: dict[str, str] = {}  # worker id -> why it waits, or its idle countdown, last said
        self._folded_said: set[str] = set()  # sources whose folding was said
        self._finished: set[str] = set()  # members of jobs that finished: their stop is the job's end
        self._last_line: dict[str, float] = {}
        self._up_bar: Any = None
        self._task_bars: dict[str, Any] = {}
        session.subscribe(self)

    def __call__(self, event: Event) -> None:
        with self._lock:
            self._router.apply(event)
            label = self._model.label
            if isinstance(event, OutputLine):
                self._on_output(event)
            elif isinstance(event, WorkerStatus):
                self._on_status(event.worker.id)
            elif isinstance(event, Progress):
                self._on_progress(event)
            elif isinstance(event, JobChanged):
                self._on_job(event)
            elif isinstance(event, LaunchFailed):
                self._write(f"[cmlcluster] {event.message}")
            elif isinstance(event, Straggler):
                self._write(f"[cmlcluster] {event.message(self._model.usage.get(event.worker or ''))}")
            elif isinstance(event, RunEnded):
                self._write(f"[{event.run}] {event.message}")
                if event.ok:  # its nodes stopped with it: each did its part
                    done = [label(i) for i in self._finished if self._model.status(i) != STOPPED]
                    if done:
                        self._write(f"[cmlcluster] {', '.join(sorted(done))} succeeded")
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

    def _on_output(self, event: OutputLine) -> None:
        name = self._model.label(event.source)
        if not is_noise(event.text):
            self._write(f"[{name}] {event.text}", event.stream)
        elif event.source not in self._folded_said:
            self._folded_said.add(event.source)
            self._write(f"[{name}] (framework INFO lines folded away here; the worker's log keeps them)")

    def _on_status(self, worker_id: str) -> None:
        model = self._model
        worker, status = model.workers[worker_id], model.status(worker_id)
        before = self._said.get(worker_id)
        self._said[worker_id] = status
        # Why it waits (a scheduler's queue), or how long it has sat idle (idle.py): said as it changes.
        message = str(worker.get("message") or "") if status in (SCHEDULING, RUNNING) else ""
        if message and message != self._message_said.get(worker_id):
            self._message_said[worker_id] = message
            self._line(f"[{model.label(worker_id)}] {'waiting: ' if status == SCHEDULING else ''}{message}")
        if status == before:
            return
        name = model.label(worker_id)
        if status == RUNNING:
            where = worker.get("hostname") or ""
            detail = f" on {where} ({worker['ip_address']})" if where else f" at {worker['ip_address']}"
            self._line(f"[{name}] running{detail}")
        elif status == FAILED:
            self._write(f"[{name}] failed: {reason(worker)}".rstrip(": "))
        elif status == STOPPED and worker_id in self._finished:
            pass  # its job is over: RunEnded says how it went, and which of them succeeded
        elif status == STOPPED and reason(worker).startswith(f"worker {worker_id} stopped: "):
            self._line(f"[{name}] {reason(worker).removeprefix(f'worker {worker_id} ')}")  # idle, ttl (idle.py)
        elif before is not None or status != SCHEDULING:
            self._line(f"[{name}] {status}")
        if self._bars and (status == SCHEDULING or self._up_bar is not None):
            self._update_up_bar()  # while workers come up

    def _line(self, text: str) -> None:
        """A status line; with bars the workers bar tells it instead."""
        if not self._bars:
            self._write(text)

    def _update_up_bar(self) -> None:
        from tqdm import tqdm

        model = self._model
        total = len(model.workers)
        up = sum(1 for r in model.workers.values() if r.get("running_at"))
        if self._up_bar is None:
            self._up_bar = tqdm(total=total, desc="workers up", unit="worker", leave=False, file=sys.stderr)
        self._up_bar.total = total
        self._up_bar.n = up
        self._up_bar.refresh()
        if not any(r["status"] == SCHEDULING for r in model.workers.values()):  # every worker came up, or will not
            self._up_bar.close()
            self._up_bar = None
            self._write(f"[cmlcluster] {total} worker{'s' * (total != 1)}: {model.summary()}")

    def _on_progress(self, progress: Progress) -> None:
        task = self._model.label(progress.task)
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
        if event.state == JobState.STARTED:
            self._write(f"[cmlcluster] {event.job} started: {len(event.members)} workers")
        elif event.state == JobState.FINISHED:
            self._finished.update(m.worker_id for m in event.members)
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
