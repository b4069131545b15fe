"""What a view of a session says, whatever draws it: one reducer over the session's events.

The widget and the terminal both draw a ViewModel, so they say the same facts in the same words:
short labels (`w0`, `ps 0`, `rank 1`) in one order, the shown status (a node of a run that ended
well is "succeeded", not "stopped"), the counts in a title, a failure's reason with its last line of
output, framework INFO noise folded away.

A notebook shows one view per call that starts or waits for work (a CallStarted event opens it):
the Router sends each event to the session's whole model and to the models of the calls it belongs
to. A worker belongs to the call current when it first appears (the one that launched it) and to
calls that name it (await_workers'); what has no worker (a rank's line, horovodrun's, a failed
launch, a run's end) belongs to the current call. Events reach the router in the order they were
published, so this is exact: a call's CallStarted is published before anything it starts.

Nothing here draws, locks or imports a UI library: the views do (widget.py, terminal.py).
"""

from __future__ import annotations

import bisect
import functools
import re
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..events import (
    CallStarted,
    Event,
    JobChanged,
    JobState,
    LaunchFailed,
    LinesDropped,
    OutputLine,
    Progress,
    ResourceUse,
    RunEnded,
    SessionClosed,
    Straggler,
    WorkerStatus,
)
from ..worker_env import short_label, worker_label
from ..workers import FAILED, RUNNING, STOPPED, SUCCEEDED, WorkerSnapshot

SCHEDULING = "scheduling"
OUTPUT_LINES = 200  # lines kept per source (the widget's panel scrolls through them)
CURVE_POINTS = 500  # points kept per loss curve (older ones thinned out)
# The order of rows and output sources: ranks first (rank 0 is where a run's story is told), then
# TensorFlow's tasks, torch's nodes and Horovod's hosts, plain workers, then the rest.
ROLE_ORDER = ("rank", "chief", "worker", "node", "host", "w", "ps", "evaluator")
# Framework INFO lines nobody reads while training: TensorFlow's C++ log ("2024-01-01 10:00:00.123: I
# tensorflow/..."), absl/glog ("I0101 10:00:00.123456 ..."), Python logging's INFO of the frameworks, and
# the second line of TensorFlow's INFO about CPU instructions, which every TensorFlow process prints.
# Folded away by default: the widget shows them on request, the worker's log keeps them all.
NOISE = re.compile(
    r"^(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: I \S+\]"
    r"|I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
    r"|INFO:(?:tensorflow|absl|torch|horovod)\b"
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.$)"
)
# The order a title counts statuses in, and the words it uses.
COUNTED = ((SCHEDULING, "starting"), (RUNNING, "running"), (SUCCEEDED, "succeeded"), (FAILED, "failed"))
GIB = 1 << 30


def resource_texts(worker: Mapping[str, Any]) -> tuple[str, str, str]:
    """What a worker asked for and, while it runs, uses, as every view says it (the widget's table, the
    panel, `cmlcluster top`): CPU "0.5 · 38 %" (of one core), memory "0.2 / 0.5 GiB" (against its limit,
    else what it asked for), GPUs "1 · 71 % · 2 / 16 GiB". `worker`: a worker dict or a session record's,
    with its latest sample in "usage" (ResourceUse.fields), if any."""
    cpu = f"{worker.get('cpu') or 0:g}"
    asked_memory = float(worker.get("memory") or 0)
    memory = f"{asked_memory:g} GiB"
    gpus = str(worker.get("nvidia_gpu") or "")
    use = worker.get("usage") if worker.get("status") == RUNNING else None
    if not use:
        return cpu, memory, gpus
    cpu += f" · {_percent(use.get('cpu_percent'))}"
    limit = use.get("memory_limit_bytes") or asked_memory * GIB
    used = _gib(use.get("memory_bytes") or 0)
    memory = f"{used} / {_gib(limit)} GiB" if limit else f"{used} GiB"
    samples = use.get("gpus") or []
    if samples:
        busy = [
            g["utilization_percent"] for g in samples if g.get("utilization_percent") == g.get("utilization_percent")
        ]
        held = sum(g.get("memory_bytes") or 0 for g in samples)
        total = sum(g.get("memory_total_bytes") or 0 for g in samples)
        util = _percent(sum(busy) / len(busy)) if busy else "- %"  # NaN (a MIG slice): unknown
        gpus = f"{len(samples)} · {util} · {_gib(held)} / {_gib(total)} GiB"
    return cpu, memory, gpus


def _percent(value: Any) -> str:
    return f"{value:.0f} %" if isinstance(value, (int, float)) and value == value else "- %"


def _gib(value: float) -> str:
    """Bytes in GiB, two significant digits under 10 (0.04, 0.5, 2, 9.5), whole ones above (16, 80)."""
    gib = value / GIB
    return f"{gib:.2g}" if gib < 10 else f"{gib:.0f}"


def is_noise(text: str) -> bool:
    return NOISE.match(text) is not None


@functools.lru_cache(maxsize=4096)  # a view sorts every row at every render: at 1,024 rows, half its time
def order_key(label: str) -> tuple[int, float, str]:
    """Sorts labels as ROLE_ORDER says, numbers as numbers: rank 2 before rank 10, w9 before w10."""
    match = re.fullmatch(r"([a-z]+) ?(\d+)", label)
    if match is None:
        return (len(ROLE_ORDER), 0.0, label)
    role, number = match.groups()
    rank = ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)
    return (rank, float(number), role)


def reason(record: dict[str, Any]) -> str:
    """A failure's reason in one line: what happened, and the last line the worker printed.

    "exited with code 3; last output:\\n...\\nValueError: bad" -> "exited with code 3: ValueError: bad".
    """
    message = str(record.get("message") or "").strip()
    if not message:
        return ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first, last = lines[0], lines[-1]
    first = re.sub(r"[;:,]?\s*(?:its )?last output:$", "", first, flags=re.IGNORECASE)
    return first if len(lines) == 1 else f"{first}: {last}"


@dataclass
class Names:
    """What every model of one session shares: each worker's label and which ended with a run that went
    well. One owner (the Router) names a worker as it first appears, and again when a job names it."""

    labels: dict[str, str] = field(default_factory=dict)  # worker id -> "w0", "ps 1", "node 0"
    ran_ok: set[str] = field(default_factory=set)  # members of a run that ended well: "stopped" is its end

    def first_seen(self, worker_id: str) -> None:
        self.labels.setdefault(worker_id, short_label(worker_id))

    def label(self, source: str) -> str:
        return self.labels.get(source, source)


class ViewModel:
    """The state of one view: its workers, their output, training progress, resource use and notes.

    Not thread-safe: its owner applies events and reads it under one lock.
    """

    def __init__(self, names: Names, title: str = ""):
        self.names = names
        self.title = title  # the call it shows ("launch_workers"); "" for the whole session
        self.workers: dict[str, dict[str, Any]] = {}  # worker id -> its latest record
        self.running_since: dict[str, float] = {}  # worker id -> when the view saw it running
        self.usage: dict[str, ResourceUse] = {}
        self.progress: dict[str, Progress] = {}  # task -> latest report
        self.curves: dict[str, tuple[list[float], list[float]]] = {}  # task -> (steps, losses)
        self.output: dict[str, deque[tuple[str, bool]]] = {}  # source -> last (line, is noise)
        self.folded: Counter[str] = Counter()  # source -> noise lines so far
        self.notes: list[str] = []
        self.stragglers: dict[str, Straggler] = {}  # task -> its flag, until it keeps pace again
        self.restarts: dict[str, int] = {}  # job -> members replaced so far
        self.jobs: dict[str, set[str]] = {}  # job -> its members' worker ids
        self.run_ended: RunEnded | None = None
        self.closed = False
        self.changes = 0  # events applied: a view redraws when it moved

    # ---------------------------------------------------------------- the reducer

    def apply(self, event: Event) -> None:
        self.changes += 1
        if isinstance(event, WorkerStatus):
            self._on_status(event.worker)
            if event.worker.finished:  # its ranks' flags go with it
                self.stragglers = {t: f for t, f in self.stragglers.items() if f.worker != event.worker.id}
        elif isinstance(event, OutputLine):
            noise = is_noise(event.text)
            self.folded[event.source] += noise
            self.output.setdefault(event.source, deque(maxlen=OUTPUT_LINES)).append((event.text, noise))
        elif isinstance(event, Progress):
            self._on_progress(event)
        elif isinstance(event, ResourceUse):
            self.usage[event.worker_id] = event
        elif isinstance(event, JobChanged):
            members = self.jobs.setdefault(event.job, set())
            members.update(m.worker_id for m in event.members if m.worker_id)
            if event.restarts:
                self.restarts[event.job] = max(event.restarts, self.restarts.get(event.job, 0))
            self.notes += event.notes()
        elif isinstance(event, LaunchFailed):
            self.notes.append(event.message)
        elif isinstance(event, Straggler):
            if event.over:
                self.stragglers.pop(event.task, None)
            else:
                self.stragglers[event.task] = event
        elif isinstance(event, RunEnded):
            self.run_ended = event
            if not event.ok:
                self.notes.append(f"{event.run}: {event.message}")
        elif isinstance(event, LinesDropped):
            self.notes.append(f"{event.count} output lines not shown (the display fell behind)")
        elif isinstance(event, SessionClosed):
            self.closed = True

    def seed(self, record: dict[str, Any], since: float | None) -> None:
        """Start with a worker another model already knows (await_workers' view of earlier workers)."""
        self.workers[record["id"]] = record
        if since is not None:
            self.running_since[record["id"]] = since

    def _on_status(self, worker: WorkerSnapshot) -> None:
        self.workers[worker.id] = worker.to_dict()  # the table's row: CML's fields, as the panel's and `top`'s
        if worker.status == RUNNING:
            self.running_since.setdefault(worker.id, time.time())
        else:
            self.running_since.pop(worker.id, None)  # its uptime no longer moves

    def _on_progress(self, progress: Progress) -> None:
        self.progress[progress.task] = progress
        loss = progress.metrics.get("loss", next(iter(progress.metrics.values()), None))
        if loss is None:
            return
        steps, losses = self.curves.setdefault(progress.task, ([], []))
        # A step again (a restart resumed from its last checkpoint): the steps since then are trained
        # again, drawn once, so the curve goes on from where training resumed instead of doubling back.
        redone = bisect.bisect_left(steps, progress.step)
        del steps[redone:], losses[redone:]
        steps.append(progress.step)
        losses.append(loss)
        if len(steps) > CURVE_POINTS:  # keep the shape, drop every other old point
            del steps[: CURVE_POINTS // 2 : 2], losses[: CURVE_POINTS // 2 : 2]

    # ---------------------------------------------------------------- what views say

    def label(self, source: str) -> str:
        return self.names.label(source)

    def status(self, worker_id: str) -> str:
        """The status a view shows: the worker's own, but "succeeded" for a member of a run that ended
        well whose end was the run's stopping it (torch's nodes and Horovod's hosts end that way)."""
        status = str(self.workers[worker_id]["status"])
        if status == STOPPED and worker_id in self.names.ran_ok:
            return SUCCEEDED
        return status

    def rows(self) -> list[dict[str, Any]]:
        """The workers' records in table order, each with "label" and the shown "status"."""
        rows = []
        for worker_id, record in self.workers.items():
            row = {**record, "label": self.label(worker_id), "status": self.status(worker_id)}
            if row["status"] != record["status"]:
                row["exit_code"] = None  # a run's end stopped it (-15): no exit of its own to show
            rows.append(row)
        return sorted(rows, key=lambda r: order_key(r["label"]))

    def counts(self) -> Counter[str]:
        return Counter(self.status(i) for i in self.workers)

    def summary(self) -> str:
        """ "2 running · 1 failed · 1 stopped": what a title says of the workers, or "closed"."""
        counts = self.counts()
        parts = [f"{counts[status]} {word}" for status, word in COUNTED if counts[status]]
        parts += [f"{n} {status}" for status, n in counts.items() if status not in dict(COUNTED) and n]
        restarts = [f"{job}: {n} restart{'s' * (n != 1)}" for job, n in self.restarts.items()]
        said = " · ".join(parts + restarts) or "no workers yet"
        return f"closed ({said})" if self.closed else said

    def sources(self) -> list[str]:
        """The output sources in order (rank 0 or worker 0 first)."""
        return sorted(self.output, key=lambda s: order_key(self.label(s)))

    def lines(self, source: str, *, noise: bool = False) -> list[str]:
        """The source's last lines; framework INFO noise only when asked for."""
        return [text for text, is_noise_line in self.output.get(source, ()) if noise or not is_noise_line]

    def straggler_lines(self) -> list[str]:
        """Each flagged straggler, with what its worker uses now (its latest sample)."""
        return [flag.message(self.usage.get(flag.worker or "")) for flag in self.stragglers.values()]

    def live(self) -> list[str]:
        """The workers still starting or running."""
        return [i for i, r in self.workers.items() if r["status"] in (SCHEDULING, RUNNING)]

    def moving(self) -> bool:
        """Whether anything shown moves by itself (an uptime)."""
        return bool(self.running_since)


class Router:
    """Sends each of a session's events to its whole model and to the models of the calls it belongs to
    (the module's docstring says which). Not thread-safe: its owner holds one lock around it."""

    def __init__(self, *, calls: bool = True) -> None:
        self.names = Names()
        self.whole = ViewModel(self.names)
        self._with_calls = calls  # False: the whole model only (a terminal tells one story)
        self._opened: dict[str, ViewModel | str] = {}  # calls opened by their callers (a call's id: joins it)
        self._models: dict[str, ViewModel] = {}  # call id -> its model, for the calls started so far
        self._run_members: set[str] = set()  # members of the jobs started since the last run ended
        self._calls: list[ViewModel] = []
        self._current: ViewModel | None = None
        self._of_worker: dict[str, list[ViewModel]] = {}  # worker id -> the calls' models it belongs to

    def open_call(self, call: str, title: str) -> ViewModel:
        """The model of a call its caller is about to start (its CallStarted is on the way)."""
        model = self._opened[call] = ViewModel(self.names, title)
        return model

    def join_call(self, call: str, into: str) -> None:
        """The call its caller is about to start joins the model of an earlier call, `into` (an await_workers
        in the cell that launched its workers): it becomes the current one again, and no view is made."""
        self._opened[call] = into

    def apply(self, event: Event) -> list[ViewModel]:
        """Apply `event`; returns the models it changed (the whole one first)."""
        if isinstance(event, CallStarted):
            return self._start_call(event) if self._with_calls else []
        if isinstance(event, WorkerStatus):
            self._first_seen(event.worker.id)
        elif isinstance(event, JobChanged):
            if event.state in (JobState.STARTED, JobState.MEMBER_REPLACED):
                for member in event.members:
                    if member.worker_id:
                        self.names.labels[member.worker_id] = worker_label(
                            member.worker_id, role=member.role, index=member.index
                        )
                        self._run_members.add(member.worker_id)
        elif isinstance(event, RunEnded):
            if event.ok:  # the run's end stopped its nodes: each of them did its part
                self.names.ran_ok.update(self._run_members)
            self._run_members.clear()
        models = [self.whole, *self._calls_of(event)]
        for model in models:
            model.apply(event)
        return models

    def calls(self) -> list[ViewModel]:
        return list(self._calls)

    def _start_call(self, event: CallStarted) -> list[ViewModel]:
        opened = self._opened.pop(event.call, None)
        joined = self._models.get(opened) if isinstance(opened, str) else None
        if joined is not None:
            model = joined
        else:  # nobody opened it (no view): a model all the same, for a view asked for later
            model = opened if isinstance(opened, ViewModel) else ViewModel(self.names, event.title)
            self._calls.append(model)
        self._models[event.call] = model
        self._current = model
        for worker_id in event.workers:
            record = self.whole.workers.get(worker_id)
            owners = self._of_worker.get(worker_id)
            if record is not None and owners is not None and model not in owners:
                model.seed(record, self.whole.running_since.get(worker_id))
                owners.append(model)
        return [model]

    def _first_seen(self, worker_id: str) -> None:
        if worker_id in self._of_worker:
            return
        self.names.first_seen(worker_id)
        self._of_worker[worker_id] = [self._current] if self._current is not None else []

    def _calls_of(self, event: Event) -> Iterable[ViewModel]:
        if isinstance(event, (LinesDropped, SessionClosed)):
            return self._calls
        worker = _worker_of(event)
        if worker is not None and worker in self._of_worker:
            return self._of_worker[worker]
        if isinstance(event, JobChanged):
            members = {m.worker_id for m in event.members}
            owners = {id(m): m for w in members for m in self._of_worker.get(w, ())}
            if owners:
                return owners.values()
        return [self._current] if self._current is not None else []


def _worker_of(event: Event) -> str | None:
    """The worker an event is about, if it is about one."""
    if isinstance(event, WorkerStatus):
        return event.worker.id
    if isinstance(event, ResourceUse):
        return event.worker_id
    if isinstance(event, OutputLine):
        return event.source
    if isinstance(event, Progress):
        return event.task
    if isinstance(event, Straggler):
        return event.worker
    return None
