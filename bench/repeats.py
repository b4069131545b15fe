"""Repeats of one measurement: each run's figures printed as it ends, their medians returned."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def medians(
    once: Callable[[], dict[str, float]], repeat: int, line: Callable[[dict[str, float]], str]
) -> dict[str, float]:
    """Run `once` `repeat` times, printing line(figures) after each; each figure's median."""
    runs = []
    for _ in range(repeat):
        runs.append(once())
        print(line(runs[-1]), flush=True)
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}
