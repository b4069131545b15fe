"""A session in a notebook: a live ipywidgets view of its workers, their output and training.

Events only change the view's state (under a lock, on the session's delivery thread);
a render thread copies the state into the widgets at most RENDER_HZ times a second,
so a worker printing a flood costs the front end ten small updates a second. The loss
curves are bqplot marks: bqplot is a native ipywidgets library (no extension build,
works in JupyterLab 4 and Notebook 7) whose traits update in place, one point at a time.
"""

from __future__ import annotations

import bisect
import html
import os
import threading
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

import ipywidgets as w

from .. import blocking, logfile, results
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
from ..workers import FAILED, RUNNING, STOPPED, SUCCEEDED
from . import kernel_internals
from .shell import in_kernel, ipython

if TYPE_CHECKING:
    from ..session import Session

RENDER_HZ = 10  # at most this many widget updates a second
OUTPUT_LINES = 200  # lines kept per source for the output panel
# The part of a worker's log that the "show log" button loads into the widget, read at the click: the
# widget's state (saved in the notebook) holds no log until then, and none again once hidden or another
# worker is selected (`cmlcluster logs` shows a log whole whatever its size).
LOG_TAIL_BYTES = 64 << 10
CURVE_POINTS = 500  # points kept per loss curve (older ones thinned out)
SHOW_LOG, HIDE_LOG = "show log", "hide log"
SHOW_LOG_TIP = "Show the end of the selected worker's log here (the saved notebook holds it while it is shown)"
HIDE_LOG_TIP = "Hide the log (the saved notebook then holds none of it)"
STOPS_THE_CELL = "Stops these workers, and the cmlcluster call a running cell waits in"
STOPS_BETWEEN_CELLS = "Stops these workers between cells; a running cell stops with Interrupt (■)"
COLOURS = {
    "scheduling": "#9e9e9e",
    RUNNING: "#1e88e5",
    SUCCEEDED: "#43a047",
    FAILED: "#e53935",
    STOPPED: "#757575",
}


class WidgetView:
    """The widget of one session; `widget` is what is displayed (and displayed again)."""

    def __init__(self, session: Session):
        self.session = session
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._rows: dict[str, dict[str, Any]] = {}  # worker id -> record
        self._running_since: dict[str, float] = {}
        self._labels: dict[str, str] = {}  # worker id -> "worker 0"
        self._progress: dict[str, Progress] = {}  # task -> latest
        self._curves: dict[str, tuple[list[float], list[float]]] = {}  # task -> (steps, losses)
        self._output: dict[str, deque[str]] = {}  # source -> last lines
        self._notes: list[str] = []
        self._restarts: dict[str, int] = {}  # job -> workers it replaced so far
        self._shown_in: object = None
        self._closed = threading.Event()  # the session closed: one last render, then the thread ends
        self.updates = 0  # renders that changed the widgets (the bench and tests read it)

        self.title = w.HTML()
        self.up = w.IntProgress(value=0, min=0, max=1, description="workers up", bar_style="info")
        self.table = w.HTML()
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger")
        self.stop_button.on_click(self._guarded(self._on_stop))
        # The click acts on arrival, while a cell may hold the kernel; the on_click above runs later.
        hooked = kernel_internals.on_arrival(self.stop_button.comm, self._guarded(self._on_stop_arrival))
        self.stop_button.tooltip = STOPS_THE_CELL if hooked else STOPS_BETWEEN_CELLS
        self.source = w.Dropdown(description="output", options=[])
        self.source.observe(self._guarded(lambda _: self._dirty.set()), names="value")
        self.output = w.HTML()
        self.log_hint = w.HTML()  # where the selected worker's whole log is, also after the session
        # Its tail, read on a click for the worker selected then; a second click hides it again.
        self.log_button = w.Button(description=SHOW_LOG, icon="file-text", tooltip=SHOW_LOG_TIP)
        self.log_button.on_click(self._guarded(self._on_log_click))
        self.log_view = w.HTML()
        self._shown_log: str | None = None  # the worker whose log's tail log_view holds
        self.errors = w.Output()  # exceptions in callbacks land here, shown under the widget
        self.training = w.VBox()
        self.task_bars: dict[str, w.FloatProgress] = {}
        self.task_metrics: dict[str, w.HTML] = {}
        self.plot, self._scales = _new_plot()
        self.plot_area = w.Box()  # holds the plot from the first loss on: no empty chart where nothing trains
        self.lines: dict[str, Any] = {}  # task -> its bqplot Lines
        self.widget = w.VBox(
            [
                w.HBox([self.title, self.stop_button]),
                self.up,
                self.table,
                self.training,
                self.plot_area,
                self.source,
                self.output,
                w.HBox([self.log_hint, self.log_button]),
                self.log_view,
                self.errors,
            ],
            layout=w.Layout(width="100%"),
        )
        self.widget.add_class("cmlcluster-session")
        self._render()
        blocking.watch(self._dirty.set)  # a call holding the cell makes Stop useful, workers or not
        session.subscribe(self._guarded(self._on_event))
        session.on_show(self.show)
        threading.Thread(target=self._render_loop, name=f"cmlcluster-{session.id}-widget", daemon=True).start()

    # ---------------------------------------------------------------- showing

    def show(self) -> None:
        """Display the widget in the cell now running, once per cell (nowhere outside a kernel)."""
        from IPython.display import display

        if not in_kernel():
            return
        shell = ipython()
        header = getattr(shell, "parent_header", None) or {}
        cell = header.get("header", {}).get("msg_id") or getattr(shell, "execution_count", None)
        if cell is not None and cell == self._shown_in:
            return
        self._shown_in = cell
        display(self.widget)

    # ---------------------------------------------------------------- events

    def _guarded(self, callback: Any) -> Any:
        """`callback`, with its exceptions shown in the widget's error area instead of lost."""

        def guarded(*args: Any) -> Any:
            try:
                return callback(*args)
            except Exception:
                self.errors.append_stderr(traceback.format_exc())
                return None

        return guarded

    def _on_event(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, WorkerStatus):
                record = event.worker
                self._rows[record["id"]] = record
                if record["status"] == RUNNING:
                    self._running_since.setdefault(record["id"], time.time())
                else:
                    self._running_since.pop(record["id"], None)  # its uptime no longer moves
            elif isinstance(event, OutputLine):
                lines = self._output.setdefault(event.source, deque(maxlen=OUTPUT_LINES))
                lines.append(event.text)
            elif isinstance(event, Progress):
                self._on_progress(event)
            elif isinstance(event, JobChanged):
                if event.state in ("started", "member_replaced"):
                    for member in event.members:
                        self._labels[member.worker_id] = f"{member.role} {member.index}"
                if event.restarts:
                    self._restarts[event.job] = max(event.restarts, self._restarts.get(event.job, 0))
                self._notes += event.notes()
            elif isinstance(event, LaunchFailed):
                self._notes.append(event.message)
            elif isinstance(event, RunEnded) and not event.ok:
                self._notes.append(f"{event.run}: {event.message}")
            elif isinstance(event, LinesDropped):
                self._notes.append(f"{event.count} output lines not shown (the display fell behind)")
            elif isinstance(event, SessionClosed):
                self._closed.set()
                blocking.unwatch(self._dirty.set)
        if not self._dirty.is_set():  # cheap when it is: a flood sets it once per render
            self._dirty.set()

    def _on_progress(self, progress: Progress) -> None:
        self._progress[progress.task] = progress
        loss = progress.metrics.get("loss", next(iter(progress.metrics.values()), None))
        if loss is None:
            return
        steps, losses = self._curves.setdefault(progress.task, ([], []))
        # A step again (a restart resumed from its last checkpoint): the steps since then are trained
        # again, drawn once, so the curve goes on from where training resumed instead of doubling back.
        redone = bisect.bisect_left(steps, progress.step)
        del steps[redone:], losses[redone:]
        steps.append(progress.step)
        losses.append(loss)
        if len(steps) > CURVE_POINTS:  # keep the shape, drop every other old point
            del steps[: CURVE_POINTS // 2 : 2], losses[: CURVE_POINTS // 2 : 2]

    def _live(self) -> list[str]:
        with self._lock:
            return [i for i, r in self._rows.items() if r["status"] not in (SUCCEEDED, FAILED, STOPPED)]

    def _on_stop(self, _button: Any) -> None:
        live = self._live()
        if live:
            self.session.stop_workers_soon(*live)

    def _on_stop_arrival(self, data: Any) -> None:
        """A click as it reaches the kernel (ipykernel's shell-channel thread): begin stopping the workers
        and end the call the cell waits in, if it is this session's. Only schedules; never waits."""
        content = data.get("content") if isinstance(data, dict) and data.get("method") == "custom" else None
        if not isinstance(content, dict) or content.get("event") != "click":
            return
        live = self._live()
        if live:
            self.session.stop_workers_soon(*live)
        blocking.interrupt(self.session, lambda: self._stopped(live))

    def _stopped(self, live: list[str]) -> str:
        """On the main thread, once the interrupted call let go: make sure of the stop, then say what stopped."""
        if not live:
            return "stopped from the widget: the call was interrupted (no workers were running)"
        names = f"worker{'s' if len(live) > 1 else ''} {', '.join(live)}"
        try:
            self.session.stop_workers(*live)
        except Exception as e:  # said, not lost: the call is over either way
            return f"stopped from the widget: stopping {names} failed: {e}"
        return f"stopped from the widget: {names} stopped"

    def _on_log_click(self, _button: Any) -> None:
        """The selected worker's log's tail into the widget, read now; or, when it is shown, hidden again."""
        worker = self.source.value
        if self._shown_log is not None:
            self._hide_log()
        elif worker in self._rows:  # a worker's output is selected (the button shows only then)
            self._shown_log, self.log_view.value = worker, _log_tail(self.session, worker)
            self.log_button.description, self.log_button.tooltip = HIDE_LOG, HIDE_LOG_TIP

    def _hide_log(self) -> None:
        self._shown_log, self.log_view.value = None, ""
        self.log_button.description, self.log_button.tooltip = SHOW_LOG, SHOW_LOG_TIP

    # ---------------------------------------------------------------- rendering

    def _render_loop(self) -> None:
        while not self._closed.is_set():
            # Woken by a change, or each second while workers run (their uptime moves).
            changed = self._dirty.wait(timeout=1.0)
            if not changed and not self._running_since:
                continue
            self._dirty.clear()
            self._render_guarded()
            time.sleep(1 / RENDER_HZ)
        self._render_guarded()  # the final state: stopped rows, "closed"

    def _render_guarded(self) -> None:
        try:
            self._render()
        except Exception:
            self.errors.append_stderr(traceback.format_exc())

    def _render(self) -> None:
        with self._lock:
            rows = [dict(r) for r in self._rows.values()]
            labels = dict(self._labels)
            since = dict(self._running_since)
            progress = dict(self._progress)
            curves = {task: (list(s), list(v)) for task, (s, v) in self._curves.items()}
            sources = list(self._output)
            selected = self.source.value or (sources[0] if sources else None)
            output = list(self._output.get(selected, ())) if selected else []
            notes = list(self._notes)
            restarts = dict(self._restarts)
            selected_worker = selected if selected in self._rows else None
        now = time.time()
        up = sum(1 for r in rows if r.get("running_at"))  # came up, whatever happened since
        session = self.session
        state = "closed" if session.closed else f"{up} of {len(rows)} workers up"
        state += "".join(f" · {html.escape(job)}: {n} restart{'s' * (n != 1)}" for job, n in restarts.items())
        self.title.value = f"<b>cmlcluster session {session.id}</b> on <code>{session.backend.name}</code>: {state}"
        self.up.max = max(len(rows), 1)
        self.up.value = up
        self.up.bar_style = "danger" if any(r["status"] == FAILED for r in rows) else "info"
        self.table.value = _table(rows, labels, since, now) + "".join(
            f'<div class="cmlcluster-note" style="color:{COLOURS[FAILED]}">{html.escape(n)}</div>' for n in notes
        )
        live = any(r["status"] not in (SUCCEEDED, FAILED, STOPPED) for r in rows)
        self.stop_button.disabled = session.closed or not (live or blocking.busy(session))
        self.stop_button.button_style = "" if self.stop_button.disabled else "danger"  # red only when it can act
        self._render_training(progress, labels)
        if self.plot is not None and curves:
            if not self.plot_area.children:
                self.plot_area.children = (self.plot,)
            self._render_curves(curves)
        names = [(labels.get(s, s), s) for s in sources]
        if names != list(self.source.options):
            self.source.options = names
            if selected in sources:
                self.source.value = selected
        self.output.value = f'<pre class="cmlcluster-output">{html.escape(chr(10).join(output))}</pre>'
        self.log_hint.value = _log_hint(session, selected_worker) if selected_worker else ""
        self.log_button.layout.display = "" if selected_worker else "none"
        if self._shown_log is not None and self._shown_log != selected_worker:
            self._hide_log()  # another worker's: gone with its selection
        self.updates += 1

    def _render_curves(self, curves: dict[str, tuple[list[float], list[float]]]) -> None:
        import bqplot

        for task, (steps, losses) in curves.items():
            line = self.lines.get(task)
            if line is None:
                palette = bqplot.CATEGORY10
                line = self.lines[task] = bqplot.Lines(
                    x=[],
                    y=[],
                    scales=self._scales,
                    labels=[task],
                    display_legend=True,
                    colors=[palette[len(self.lines) % len(palette)]],
                )
                self.plot.marks = [*self.plot.marks, line]
            if len(line.x) != len(steps) or (steps and line.x[-1] != steps[-1]):
                with line.hold_sync():
                    line.x, line.y = steps, losses

    def _render_training(self, progress: dict[str, Progress], labels: dict[str, str]) -> None:
        for task, report in progress.items():
            bar = self.task_bars.get(task)
            if bar is None:
                bar = self.task_bars[task] = w.FloatProgress(min=0, description=labels.get(task, task))
                self.task_metrics[task] = w.HTML()
                self.training.children = (*self.training.children, w.HBox([bar, self.task_metrics[task]]))
            bar.max = report.total or max(report.step, 1)
            bar.value = min(report.step, bar.max)
            bar.bar_style = "success" if report.total and report.step >= report.total else ""
            self.task_metrics[task].value = html.escape(describe(report))


def _log_hint(session: Session, worker_id: str) -> str:
    """The selected worker's whole log: its file, and the command that shows it after the session."""
    path = html.escape(session.worker_log_path(worker_id))
    command = html.escape(f"cmlcluster logs {session.id} {worker_id}")
    return (
        f'<div class="cmlcluster-log">whole log: <code>{path}</code>, after the session: <code>{command}</code></div>'
    )


def _log_tail(session: Session, worker_id: str) -> str:
    """The last LOG_TAIL_BYTES of the worker's log (from a line's start), and how much of it that is."""
    path = session.worker_log_path(worker_id)
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    text = logfile.read_tail(path, LOG_TAIL_BYTES)
    if size > LOG_TAIL_BYTES and "\n" in text:
        text = text.partition("\n")[2]  # the first line is cut
    shown = len(text.encode())
    what = (
        f"the whole log ({results.size_text(shown)})"
        if shown >= size
        else (f"its last {results.size_text(shown)} of {results.size_text(size)}")
    )
    return (
        f'<div class="cmlcluster-log-tail">{html.escape(worker_id)}.log, {what}:</div>'
        f'<pre class="cmlcluster-log-tail">{html.escape(text)}</pre>'
    )


def _table(rows: list[dict[str, Any]], labels: dict[str, str], since: dict[str, float], now: float) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("worker", "status", "host", "address", "GPUs", "up for", "exit", "reason"))
    body = []
    for r in rows:
        started = since.get(r["id"])
        uptime = "" if started is None or r["status"] != RUNNING else f"{now - started:.0f} s"
        name = labels.get(r["id"], r["id"])
        exit_code = "" if r.get("exit_code") is None else str(r["exit_code"])
        reason = r.get("message", "") if r["status"] == FAILED else ""
        cells = [
            html.escape(name),
            f'<span style="color:{COLOURS.get(r["status"], "inherit")}">&#9679; {r["status"]}</span>',
            html.escape(r.get("hostname") or ""),
            html.escape(r.get("ip_address") or ""),
            str(r.get("nvidia_gpu") or ""),
            uptime,
            exit_code,
            f'<span title="{html.escape(reason)}">{html.escape(reason.splitlines()[0] if reason else "")}</span>',
        ]
        body.append(
            f'<tr data-worker="{html.escape(r["id"])}" data-status="{r["status"]}">'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    return f'<table class="cmlcluster-workers"><tr>{head}</tr>{"".join(body)}</table>'


def _new_plot() -> tuple[Any, dict[str, Any]]:
    """A bqplot figure for the loss curves and its scales, or (None, {}) without bqplot."""
    try:
        import bqplot
    except ImportError:
        return None, {}
    x, y = bqplot.LinearScale(), bqplot.LinearScale()
    figure = bqplot.Figure(
        marks=[],
        axes=[bqplot.Axis(scale=x, label="step"), bqplot.Axis(scale=y, side="left", label="loss")],
        title="loss",
        layout=w.Layout(width="100%", height="300px"),
        legend_location="top-right",
    )
    figure.add_class("cmlcluster-loss")
    return figure, {"x": x, "y": y}
