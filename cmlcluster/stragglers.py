"""Stragglers named: a rank (or TensorFlow task) whose steps come more than `fraction` slower than the median of
its peers' over the last `window` seconds, from the progress they report (cmlcluster.report, the Keras
callback), flagged in the views and as a Straggler event, with its worker's CPU and GPU use; the view's
X-ray button then shows where it stands.

Peers are reporters of one kind: "rank 0" … "rank 7" are peers, as are TensorFlow's "worker 0" … (a
coordinator or a lone reporter has none). A reporter's rate is its steps over the window that ends now, so
one that stopped reporting (hung) falls to 0 and is flagged; it is judged only once it has reported for a
whole window (warm-up, a restart's first steps), and only where two peers or more have. One flagged is
named once, and again when it catches up to within half the fraction (over=True). In lock-step training
(DDP, Horovod) every rank steps at the slowest one's pace: the rates agree, and the straggler shows in
the X-ray instead, the others waiting for it in their collective.
"""

from __future__ import annotations

import collections
import re
import statistics
from dataclasses import dataclass, field

from .events import Progress, Straggler

STRAGGLER_FRACTION = 0.3  # slower than the median by more than this share of it
STRAGGLER_WINDOW = 30.0  # seconds of steps a rate is measured over

_NUMBERED = re.compile(r"^(.*\S)\s+\d+$")  # "rank 3" -> "rank"


def peer_kind(task: str) -> str | None:
    """The kind a reporter's peers share ("rank" for "rank 3"); None for one without a number."""
    match = _NUMBERED.match(task)
    return match.group(1) if match else None


@dataclass
class StragglerWatch:
    """Each reporter's recent steps, and which are flagged; one per session, fed its Progress events."""

    fraction: float = STRAGGLER_FRACTION
    window: float = STRAGGLER_WINDOW
    _steps: dict[str, collections.deque[tuple[float, float]]] = field(default_factory=dict)  # task -> (time, step)
    _workers: dict[str, str | None] = field(default_factory=dict)  # task -> the worker it reports from
    _flagged: set[str] = field(default_factory=set)

    def sample(self, progress: Progress) -> list[Straggler]:
        """Take in one report; the flags it raises or lowers among the reporter's peers."""
        kind = peer_kind(progress.task)
        if kind is None:
            return []
        steps = self._steps.setdefault(progress.task, collections.deque())
        if steps and progress.step < steps[-1][1]:
            steps.clear()  # it started over (a restart from a checkpoint): a new history
        steps.append((progress.time, progress.step))
        self._workers[progress.task] = progress.worker
        return self.judge(kind, progress.time)

    def judge(self, kind: str, now: float) -> list[Straggler]:
        """The flags that change now among the reporters of one kind."""
        rates = {}
        for task in self._steps:
            if peer_kind(task) == kind and (rate := self._rate(task, now)) is not None:
                rates[task] = rate
        if len(rates) < 2:
            return []
        median = statistics.median(rates.values())
        changes = []
        for task, rate in sorted(rates.items()):
            flagged = task in self._flagged
            # Flagged below the fraction, cleared only past half of it: a pace near the line, measured
            # as each peer reports in turn, would raise and lower the flag at every report.
            slow = rate < median * (1 - (self.fraction / 2 if flagged else self.fraction))
            if slow == flagged:
                continue
            if slow:
                self._flagged.add(task)
            else:
                self._flagged.discard(task)
            worker = self._workers.get(task)
            changes.append(Straggler(task, worker, rate, median, kind, self.fraction, self.window, over=not slow))
        return changes

    def _rate(self, task: str, now: float) -> float | None:
        """Steps a second over the window ending now; None before the reporter has a window of history."""
        steps = self._steps[task]
        start = now - self.window
        while len(steps) > 1 and steps[1][0] <= start:
            steps.popleft()  # keep one report at or before the window's start: its baseline
        if steps[0][0] > start:
            return None
        return (steps[-1][1] - steps[0][1]) / (now - steps[0][0])
