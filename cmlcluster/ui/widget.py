"""A session in a notebook: live ipywidgets views of its workers, their output and training.

Each call that starts or waits for work (launch_workers, await_workers, run_cluster, %horovod,
%torchrun, run_*) shows a view of its own in its cell: its workers, its run's output and progress
(model.py's Router says what belongs to which call). Displaying the session (`cmlcluster.get_session()`
as a cell's value) shows the whole session's view.

Events only change the models (under the session's views' lock, on one delivery thread); one render
thread copies what changed into the widgets at most RENDER_HZ times a second, so a worker printing a
flood costs the front end ten small updates a second, however many views there are. The loss curves
are bqplot marks: bqplot is a native ipywidgets library (no extension build, works in JupyterLab 4 and
Notebook 7) whose traits update in place, one point at a time.
"""

from __future__ import annotations

import html
import os
import threading
import time
import traceback
from collections import Counter
from typing import Any

import ipywidgets as w

from .. import blocking, logfile
from ..collect import paths as results
from ..events import CallStarted, Event, Progress, ResourceUse, SessionClosed
from ..progress import describe
from ..viewers import ViewedSession
from ..workers import FAILED, RUNNING, STOPPED, SUCCEEDED
from . import kernel_internals
from .attached import remember, view_of
from .model import SCHEDULING, Router, ViewModel, order_key, reason, resource_texts
from .shell import importable, in_kernel, ipython

# Rows a view's table shows: past a screenful a row is one count in a line under it (at 1,024 workers the
# table's HTML alone took 21 ms a render and 0.3 MB a message to the browser).
TABLE_ROWS = 40
RENDER_HZ = 10  # at most this many widget updates a second, for all of a session's views together
# The part of a worker's log that the "show log" button loads into the widget, read at the click: the
# widget's state (saved in the notebook) holds no log until then, and none again once hidden or another
# worker is selected (`cmlcluster logs` shows a log whole whatever its size).
LOG_TAIL_BYTES = 64 << 10
OUTPUT_HEIGHT = "18em"  # the output panel scrolls within this, its newest line in sight
SHOW_LOG, HIDE_LOG = "show log", "hide log"
SHOW_LOG_TIP = "Show the end of the selected worker's log here (the saved notebook holds it while it is shown)"
HIDE_LOG_TIP = "Hide the log (the saved notebook then holds none of it)"
STOPS_THE_CELL = "Stops these workers, and the cmlcluster call a running cell waits in"
STOPS_BETWEEN_CELLS = "Stops these workers between cells; a running cell stops with Interrupt (■)"
XRAY_TIP = "Where every rank of these workers is now: each thread's Python stack, the odd ones out named"
NOISE_TIP = "Show the frameworks' INFO log lines too (folded away by default; the worker's log keeps them all)"
LOG_SCALE_TIP = (
    "A log scale for the loss (a run that diverged no longer flattens the others; losses <= 0 are not drawn)"
)
STRAGGLER_COLOUR = "#ef6c00"  # a warning, not a failure
COLOURS = {
    SCHEDULING: "#9e9e9e",
    RUNNING: "#1e88e5",
    SUCCEEDED: "#43a047",
    FAILED: "#e53935",
    STOPPED: "#757575",
}


class SessionViews:
    """The widget views of one session: a view per call, and the whole session's on request.

    One subscriber feeds every view's model through a Router, and one thread draws them.
    """

    def __init__(self, session: ViewedSession):
        self.session = session
        self.lock = threading.Lock()  # the models, and the views' list
        self.router = Router()
        self.views: list[WidgetView] = []
        self.latest: WidgetView | None = None  # the newest call's view: what the Stop in the last cell is
        self.whole_view: WidgetView | None = None
        self._uptimes_drawn = 0.0  # when running workers' uptimes were last drawn (monotonic)
        self._dirty = threading.Event()
        self._closed = threading.Event()  # the session closed: one last render, then the thread ends
        self._cells: dict[str, object] = {}  # call -> the cell its view is shown in
        self.errors: list[str] = []  # what failed in the delivery thread (shown by the views)
        blocking.watch(self.redraw_all)  # a call holding the cell makes Stop useful, workers or not
        session.subscribe(self._on_event)
        session.on_show(self.show_call)
        threading.Thread(target=self._render_loop, name=f"cmlcluster-{session.id}-widgets", daemon=True).start()

    @classmethod
    def of(cls, session: ViewedSession) -> SessionViews:
        """The session's views (made at its first need)."""
        views = view_of(session)
        return views if isinstance(views, SessionViews) else remember(session, cls(session))

    # ---------------------------------------------------------------- showing

    def show_call(self, call: CallStarted) -> None:
        """At a call's start, in the caller's thread: show its view in the cell now running. A wait for
        workers that one call launched in this same cell (await_workers after launch_workers) joins
        that call's view instead."""
        if not in_kernel():
            return
        cell = _current_cell()
        launchers = {self.session.launched_by(worker) for worker in call.workers}
        with self.lock:
            if len(launchers) == 1 and cell is not None:
                [launcher] = launchers
                if launcher is not None and self._cells.get(launcher) == cell:
                    self.router.join_call(call.call, launcher)
                    return
            model = self.router.open_call(call.call, call.title)
        view = WidgetView(self.session, self, model, call.call)  # draws itself once: outside the lock
        with self.lock:
            self.views.append(view)
            self.latest = view
            self._cells[call.call] = cell
        view.display()

    def whole(self) -> WidgetView:
        """The whole session's view (every worker, all output)."""
        with self.lock:
            if self.whole_view is not None:
                return self.whole_view
        view = WidgetView(self.session, self, self.router.whole, "")
        with self.lock:
            self.views.append(view)
            self.whole_view = self.whole_view or view
            return self.whole_view

    # ---------------------------------------------------------------- events

    def _on_event(self, event: Event) -> None:
        try:
            with self.lock:
                self.router.apply(event)
        except Exception:
            self.errors.append(traceback.format_exc())
        if isinstance(event, SessionClosed):
            self._closed.set()
            blocking.unwatch(self.redraw_all)
        if not self._dirty.is_set():  # cheap when it is: a flood sets it once per render
            self._dirty.set()

    # ---------------------------------------------------------------- rendering

    def _render_loop(self) -> None:
        while not self._closed.is_set():
            # Woken by a change, or each second while workers run (their uptime moves).
            self._dirty.wait(timeout=1.0)
            self._dirty.clear()
            started = time.monotonic()
            uptimes = started - self._uptimes_drawn >= 1.0
            if uptimes:
                self._uptimes_drawn = started
            self._render_all(uptimes)
            # One render per 1/RENDER_HZ s, counted from its start: a render that took long (1,024 rows while
            # all of them print) no longer lowers the rate (a pause after each: 3.9 updates a second there).
            time.sleep(max(0.0, started + 1 / RENDER_HZ - time.monotonic()))
        self._render_all(uptimes=True)  # the final state: stopped rows, "closed"

    def _render_all(self, uptimes: bool) -> None:
        with self.lock:
            views = list(self.views)
        for view in views:
            view.render_if_changed(uptimes)

    def kick(self) -> None:
        """Draw again soon (a user's choice in a view changed what it shows)."""
        self._dirty.set()

    def redraw_all(self) -> None:
        """Draw every view again soon (whether a call holds the cell changed: their Stop buttons)."""
        with self.lock:
            for view in self.views:
                view.stale()
        self._dirty.set()


class WidgetView:
    """The widget of one model: a call's, or the whole session's. `widget` is what is displayed.

    WidgetView(session) is the whole session's view (made for it if the session has none yet).
    """

    def __init__(
        self, session: ViewedSession, views: SessionViews | None = None, model: ViewModel | None = None, call: str = ""
    ):
        if views is None:  # the whole session's, asked for by name
            views = SessionViews.of(session)
            model = views.router.whole
            with views.lock:
                views.views.append(self)
                views.whole_view = views.whole_view or self
        assert model is not None
        self.session = session
        self.views = views
        self.model = model
        self.call = call
        self._drawn = -1  # the model's changes when last drawn
        self._shown_log: str | None = None  # the worker whose log's tail log_view holds
        self._hinted: str | None = None  # the worker whose log's path log_hint names
        self.updates = 0  # renders that changed the widgets (the bench and tests read it)
        self.lines: dict[str, Any] = {}  # task -> its bqplot Lines
        self.task_bars: dict[str, w.FloatProgress] = {}
        self.task_metrics: dict[str, w.HTML] = {}
        self._errors_shown = 0

        self.title = w.HTML()
        self.up = w.IntProgress(value=0, min=0, max=1, description="workers up", bar_style="info")
        self.table = w.HTML()
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger")
        self.stop_button.on_click(self._guarded(self._on_stop))
        # The click acts on arrival, while a cell may hold the kernel; the on_click above runs later.
        hooked = kernel_internals.on_arrival(self.stop_button.comm, self._guarded(self._on_stop_arrival))
        self.stop_button.tooltip = STOPS_THE_CELL if hooked else STOPS_BETWEEN_CELLS
        # Where every rank of the view's workers is now (cmlcluster/stacks): asked on the click's arrival,
        # while the cell runs on; the answer is drawn under the table.
        self.xray_button = w.Button(description="X-ray", icon="search", tooltip=XRAY_TIP)
        self.xray_button.on_click(self._guarded(self._on_xray))
        self._xray_on_arrival = kernel_internals.on_arrival(self.xray_button.comm, self._guarded(self._on_xray_arrival))
        self.xray_view = w.HTML()
        self._xray: str | None = None  # the last X-ray's HTML, drawn at the next render; "" while one is taken
        self.source = w.Dropdown(description="output", options=[])
        self.source.observe(self._guarded(self._on_pick), names="value")
        self._picked = False  # the user chose a source: kept; until then the first in order (w0, rank 0)
        self._drawing = False  # set while _render assigns the dropdown (not the user's pick)
        self.noise = w.Checkbox(value=False, description="framework logs", tooltip=NOISE_TIP, indent=False)
        self.noise.observe(self._guarded(lambda _: self._redraw()), names="value")
        self.output = w.HTML()
        # Where the selected worker's whole log is, also after the session.
        self.log_hint = w.HTML(layout=w.Layout(flex="1 1 auto"))
        # Its tail, read on a click for the worker selected then; a second click hides it again.
        self.log_button = w.Button(
            description=SHOW_LOG, icon="file-text", tooltip=SHOW_LOG_TIP, layout=w.Layout(flex="0 0 auto")
        )
        self.log_button.on_click(self._guarded(self._on_log_click))
        self.log_view = w.HTML()
        self.errors = w.Output()  # exceptions in callbacks land here, shown under the widget
        self.training = w.VBox()
        # The loss plot and its scales, made at the first loss: a view per call, and most calls train nothing.
        self.plot: Any = None
        self._scales: dict[str, Any] = {}
        self._can_plot = importable("bqplot")
        self.legend = w.HTML()  # beside the plot, never over its curves
        self.log_scale = w.ToggleButton(value=False, description="log scale", tooltip=LOG_SCALE_TIP)
        self.log_scale.observe(self._guarded(self._on_log_scale), names="value")
        self.plot_area = w.Box()  # holds the plot from the first loss on: no empty chart where nothing trains
        self.widget = w.VBox(
            [
                w.HBox([self.title, self.xray_button, self.stop_button]),
                self.up,
                self.table,
                self.xray_view,
                self.training,
                self.plot_area,
                w.HBox([self.source, self.noise]),
                self.output,
                w.HBox([self.log_hint, self.log_button]),  # the button keeps its width: the hint wraps
                self.log_view,
                self.errors,
            ],
            layout=w.Layout(width="100%"),
        )
        self.widget.add_class("cmlcluster-session")
        self._render_guarded()

    def display(self) -> None:
        from IPython.display import display

        display(self.widget)

    # ---------------------------------------------------------------- user actions

    def _guarded(self, callback: Any) -> Any:
        """`callback`, with its exceptions shown in the widget's error area instead of lost."""

        def guarded(*args: Any) -> Any:
            try:
                return callback(*args)
            except Exception:
                self.errors.append_stderr(traceback.format_exc())
                return None

        return guarded

    def stale(self) -> None:
        """Drawn again at the next render, changed or not."""
        self._drawn = -1

    def _on_pick(self, _change: Any) -> None:
        if not self._drawing:
            self._picked = True
        self._redraw()

    def _redraw(self) -> None:
        self.stale()
        self.views.kick()

    def _live(self) -> list[str]:
        with self.views.lock:
            return self.model.live()

    def _on_stop(self, _button: Any) -> None:
        live = self._live()
        if live:
            self.session.stop_workers_soon(*live)

    def _on_stop_arrival(self, data: Any) -> None:
        """A click as it reaches the kernel (ipykernel's shell-channel thread): begin stopping the view's
        workers and end the call the cell waits in, if it is this session's. Only schedules; never waits."""
        content = data.get("content") if isinstance(data, dict) and data.get("method") == "custom" else None
        if not isinstance(content, dict) or content.get("event") != "click":
            return
        live = self._live()
        if live:
            self.session.stop_workers_soon(*live)
        if self._ends_the_running_call(live):
            blocking.interrupt(self.session, lambda: self._stopped(live))

    def _on_xray(self, _button: Any) -> None:
        if not self._xray_on_arrival:  # a kernel that hands the click over only between cells
            self._take_xray()

    def _on_xray_arrival(self, data: Any) -> None:
        """A click as it reaches the kernel: the X-ray is asked for on the session's loop; never waits."""
        content = data.get("content") if isinstance(data, dict) and data.get("method") == "custom" else None
        if isinstance(content, dict) and content.get("event") == "click":
            self._take_xray()

    def _take_xray(self) -> None:
        live = self._live()
        if not live or self._xray == "":
            return  # nothing runs, or one is on its way
        self._xray = ""
        self._redraw()
        self.session.xray_soon(self._xray_taken, *live)

    def _xray_taken(self, result: Any) -> None:
        """On the session's loop: the X-ray (or why there is none), drawn at the next render."""
        if isinstance(result, BaseException):
            self._xray = f"<div class='cmlcluster-xray'>X-ray failed: {html.escape(str(result))}</div>"
        else:
            self._xray = result.html()
        self._redraw()

    def _ends_the_running_call(self, live: list[str]) -> bool:
        """Whether this click also ends the call a cell waits in: the newest view's (the running cell's) and
        the whole session's do; an older cell's only when the newest view shows some of the workers it stops
        (an await_workers in a later cell of the workers this view launched)."""
        latest = self.views.latest
        if self in (latest, self.views.whole_view):
            return True
        with self.views.lock:
            return latest is not None and not set(live).isdisjoint(latest.model.workers)

    def _stopped(self, live: list[str]) -> str:
        """On the main thread, once the interrupted call let go: make sure of the stop, then say what stopped."""
        if not live:
            return "stopped from the widget: the call was interrupted (no workers were running)"
        with self.views.lock:
            names = ", ".join(self.model.label(i) for i in live)
        what = f"worker{'s' if len(live) > 1 else ''} {names}"
        try:
            self.session.stop_workers(*live)
        except Exception as e:  # said, not lost: the call is over either way
            return f"stopped from the widget: stopping {what} failed: {e}"
        return f"stopped from the widget: {what} stopped"

    def _on_log_click(self, _button: Any) -> None:
        """The selected worker's log's tail into the widget, read now; or, when it is shown, hidden again."""
        worker = self.source.value
        if self._shown_log is not None:
            self._hide_log()
        elif worker in self.model.workers:  # a worker's output is selected (the button shows only then)
            self._shown_log, self.log_view.value = worker, _log_tail(self.session, worker)
            self.log_button.description, self.log_button.tooltip = HIDE_LOG, HIDE_LOG_TIP

    def _hide_log(self) -> None:
        self._shown_log, self.log_view.value = None, ""
        self.log_button.description, self.log_button.tooltip = SHOW_LOG, SHOW_LOG_TIP

    def _on_log_scale(self, change: Any) -> None:
        if self.plot is None:
            return
        y = self._scales["log" if change["new"] else "y"]
        with self.plot.hold_sync():
            self.plot.axes[1].scale = y
            for line in self.plot.marks:
                line.scales = {**line.scales, "y": y}

    # ---------------------------------------------------------------- rendering

    def render_if_changed(self, uptimes: bool) -> None:
        """Draw what changed (or, with `uptimes`, what moves by itself: running workers' uptime)."""
        with self.views.lock:
            changed = self.model.changes != self._drawn
            moving = self.model.moving()
        if changed or (uptimes and moving) or self._errors_shown < len(self.views.errors):
            self._render_guarded()

    def _render_guarded(self) -> None:
        try:
            self._render()
        except Exception:
            self.errors.append_stderr(traceback.format_exc())

    def _render(self) -> None:
        with self.views.lock:
            model = self.model
            self._drawn = model.changes
            rows = model.rows()
            since = dict(model.running_since)
            usage = dict(model.usage)
            progress = {task: (model.label(task), report) for task, report in model.progress.items()}
            curves = {task: (model.label(task), list(s), list(v)) for task, (s, v) in model.curves.items()}
            sources = model.sources()
            names = [(model.label(source), source) for source in sources]
            picked = self._picked and self.source.value in sources
            selected = self.source.value if picked else (sources[0] if sources else None)
            output = model.lines(selected, noise=self.noise.value) if selected else []
            folded = model.folded[selected] if selected and not self.noise.value else 0
            notes = list(model.notes)
            stragglers = model.straggler_lines()
            summary = model.summary()
            live = bool(model.live())
            selected_worker = selected if selected in model.workers else None
            errors = self.views.errors[self._errors_shown :]
            self._errors_shown += len(errors)
        for error in errors:
            self.errors.append_stderr(error)
        session = self.session
        what = f"<b>{html.escape(model.title)}</b> · " if model.title else "<b>cmlcluster</b> "
        self.title.value = (
            f"{what}session {session.id} on <code>{html.escape(session.backend.name)}</code>: {html.escape(summary)}"
        )
        up = sum(1 for r in rows if r.get("running_at"))  # came up, whatever happened since
        self.up.max = max(len(rows), 1)
        self.up.value = up
        self.up.bar_style = "danger" if any(r["status"] == FAILED for r in rows) else "info"
        self.up.layout.display = "none" if rows and up == len(rows) else ""  # gone once every worker came up
        notes_html = "".join(_note(n, "cmlcluster-note", COLOURS[FAILED]) for n in notes)
        notes_html += "".join(_note(s, "cmlcluster-straggler", STRAGGLER_COLOUR) for s in stragglers)
        self.table.value = _table(rows, since, usage, time.time()) + notes_html
        # A call holding the cell is the newest view's to stop (or the whole session's), not an older cell's.
        holds = blocking.busy(session) and self in (self.views.latest, self.views.whole_view)
        self.stop_button.disabled = session.closed or not (live or holds)
        self.stop_button.button_style = "" if self.stop_button.disabled else "danger"  # red only when it can act
        self.xray_button.disabled = session.closed or not live or self._xray == ""
        if self._xray is not None:
            self.xray_view.value = self._xray or "<div class='cmlcluster-xray'>X-ray: asking every worker…</div>"
        self._render_training(progress)
        if curves and self.plot is None and self._can_plot:
            self.plot, self._scales = _new_plot()
            if self.plot is not None:
                beside = w.VBox([self.legend, self.log_scale], layout=w.Layout(flex="0 0 auto"))
                self.plot_area.children = (w.HBox([self.plot, beside], layout=w.Layout(width="100%")),)
        if curves and self.plot is not None:
            self._render_curves(curves)
        self._drawing = True
        try:
            if names != list(self.source.options):
                self.source.options = names
            if self.source.value != selected:
                self.source.value = selected
        finally:
            self._drawing = False
        self.output.value = _output_panel(output, folded)
        self.noise.layout.display = "" if folded or self.noise.value else "none"
        if selected_worker != self._hinted:  # its path is made once (a folder made, a stat), not every render
            self._hinted = selected_worker
            self.log_hint.value = _log_hint(session, selected_worker) if selected_worker else ""
        self.log_button.layout.display = "" if selected_worker else "none"
        if self._shown_log is not None and self._shown_log != selected_worker:
            self._hide_log()  # another worker's: gone with its selection
        self.updates += 1

    def _render_curves(self, curves: dict[str, tuple[str, list[float], list[float]]]) -> None:
        import bqplot

        palette = bqplot.CATEGORY10
        for task, (label, steps, losses) in curves.items():
            line = self.lines.get(task)
            if line is None:
                y = self._scales["log" if self.log_scale.value else "y"]
                colour = palette[len(self.lines) % len(palette)]
                line = self.lines[task] = bqplot.Lines(
                    x=[], y=[], scales={"x": self._scales["x"], "y": y}, labels=[label], colors=[colour]
                )
                self.plot.marks = [*self.plot.marks, line]
            if line.labels != [label]:  # a job named its worker since
                line.labels = [label]
            if len(line.x) != len(steps) or (steps and line.x[-1] != steps[-1]):
                with line.hold_sync():
                    line.x, line.y = steps, losses
        ordered = sorted(self.lines.values(), key=lambda line: order_key(line.labels[0]))
        legend = '<div class="cmlcluster-legend">{}</div>'.format(
            "".join(
                f'<div><span style="color:{line.colors[0]}">&#9473;&#9473;</span> {html.escape(line.labels[0])}</div>'
                for line in ordered
            )
        )
        if self.legend.value != legend:
            self.legend.value = legend

    def _render_training(self, progress: dict[str, tuple[str, Progress]]) -> None:
        for task, (label, report) in progress.items():
            bar = self.task_bars.get(task)
            if bar is None:
                bar = self.task_bars[task] = w.FloatProgress(min=0, description=label)
                self.task_metrics[task] = w.HTML()
                self.training.children = (*self.training.children, w.HBox([bar, self.task_metrics[task]]))
            bar.description = label
            bar.max = report.total or max(report.step, 1)
            bar.value = min(report.step, bar.max)
            bar.bar_style = "success" if report.total and report.step >= report.total else ""
            self.task_metrics[task].value = html.escape(describe(report))


def _current_cell() -> object:
    """The cell now running (its request's id), or None outside one."""
    shell = ipython()
    header = getattr(shell, "parent_header", None) or {}
    return header.get("header", {}).get("msg_id") or getattr(shell, "execution_count", None)


def _output_panel(lines: list[str], folded: int) -> str:
    """The selected source's lines in a fixed-height panel that scrolls: column-reverse keeps its
    newest line in sight as lines arrive, without a script."""
    note = (
        f'<div class="cmlcluster-folded">{folded} framework INFO line{"s" * (folded != 1)} folded away '
        "(tick <i>framework logs</i> to show them)</div>"
        if folded
        else ""
    )
    return (
        f'<div class="cmlcluster-output-panel" style="max-height:{OUTPUT_HEIGHT};overflow-y:auto;'
        'display:flex;flex-direction:column-reverse">'
        f'<pre class="cmlcluster-output" style="margin:0">{html.escape(chr(10).join(lines))}</pre></div>{note}'
    )


def _log_hint(session: ViewedSession, worker_id: str) -> str:
    """The selected worker's whole log: its file, and the command that shows it after the session."""
    path = html.escape(session.worker_log_path(worker_id))
    command = html.escape(f"cmlcluster logs {session.id} {worker_id}")
    return (
        f'<div class="cmlcluster-log">whole log: <code>{path}</code>, after the session: <code>{command}</code></div>'
    )


def _note(text: str, css_class: str, colour: str) -> str:
    return f'<div class="{css_class}" style="color:{colour}">{html.escape(text)}</div>'


def _log_tail(session: ViewedSession, worker_id: str) -> str:
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


def shown_rows(rows: list[dict[str, Any]], limit: int = TABLE_ROWS) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The rows a table shows, in table order, and the statuses of those it leaves out: all of them up to
    `limit`; past it, the failed ones first (what a user looks for at 1,024 workers), then the first in
    order. A row not shown is counted by its status, in a line of its own under the table."""
    if len(rows) <= limit:
        return rows, Counter()
    failed = [r for r in rows if r["status"] == FAILED][:limit]
    shown_ids = {r["id"] for r in failed}
    for r in rows:
        if len(shown_ids) >= limit:
            break
        shown_ids.add(r["id"])
    shown = [r for r in rows if r["id"] in shown_ids]
    return shown, Counter(r["status"] for r in rows if r["id"] not in shown_ids)


def _table(rows: list[dict[str, Any]], since: dict[str, float], usage: dict[str, ResourceUse], now: float) -> str:
    rows, left_out = shown_rows(rows)
    head = "".join(
        f"<th>{h}</th>"
        for h in ("worker", "status", "host", "address", "CPU", "memory", "GPUs", "up for", "exit", "reason")
    )
    body = []
    for r in rows:
        started = since.get(r["id"])
        uptime = "" if started is None or r["status"] != RUNNING else f"{now - started:.0f} s"
        exit_code = "" if r.get("exit_code") is None else str(r["exit_code"])
        # A failure's; a scheduling one's: why it waits; a running one's: its idle countdown (idle.py); a
        # stopped one's: who stopped it, where not this session's caller (an idle_timeout, a scheduler).
        why = reason(r)
        name = f' <span style="color:#757575">{html.escape(r["name"])}</span>' if r.get("name") else ""
        sample = usage.get(r["id"])
        cpu, memory, gpus = resource_texts({**r, "usage": sample.fields() if sample else None})
        cells = [
            html.escape(r["label"]) + name,
            f'<span style="color:{COLOURS.get(r["status"], "inherit")}">&#9679; {r["status"]}</span>',
            html.escape(r.get("hostname") or ""),
            html.escape(r.get("ip_address") or ""),
            cpu,
            memory,
            gpus,
            uptime,
            exit_code,
            f'<span title="{html.escape(str(r.get("message") or ""))}">{html.escape(why)}</span>',
        ]
        body.append(
            f'<tr data-worker="{html.escape(r["id"])}" data-status="{r["status"]}">'
            + "".join(f"<td>{c}</td>" for c in cells[:-1])
            + f'<td style="white-space:normal">{cells[-1]}</td>'
            + "</tr>"
        )
    if left_out:
        counts = " · ".join(f"{n} {status}" for status, n in sorted(left_out.items(), key=lambda c: -c[1]))
        body.append(
            f'<tr class="cmlcluster-more"><td colspan="10">… and {sum(left_out.values())} more ({counts}): '
            "<code>cmlcluster list</code> or <code>list_workers()</code> shows every one</td></tr>"
        )
    # One line per cell ("0.5 · 38 %" never broken), but the reason's, which may be long.
    return f'<table class="cmlcluster-workers" style="white-space:nowrap"><tr>{head}</tr>{"".join(body)}</table>'


def _new_plot() -> tuple[Any, dict[str, Any]]:
    """A bqplot figure for the loss curves and its scales (a linear and a log one for y), or (None, {})
    without bqplot. The legend is drawn beside it (WidgetView.legend): bqplot's own covers the curves."""
    try:
        import bqplot
    except ImportError:
        return None, {}
    x, y, log = bqplot.LinearScale(), bqplot.LinearScale(), bqplot.LogScale()
    figure = bqplot.Figure(
        marks=[],
        axes=[bqplot.Axis(scale=x, label="step"), bqplot.Axis(scale=y, side="left", label="loss")],
        title="loss",
        layout=w.Layout(flex="1 1 auto", min_width="320px", height="300px"),
    )
    figure.add_class("cmlcluster-loss")
    return figure, {"x": x, "y": y, "log": log}
