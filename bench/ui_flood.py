"""The UI's cost under an output flood: the same job with and without the session widget.

One local worker prints N lines (default 100,000) and reports progress; the job is
timed from launch until every line has reached the session, with a WidgetView
attached (its render thread copying state into ipywidgets, as in a notebook) and
without one, alternating in the same process. Printed: the medians, their ratio
(goal <= 1.05), and the widget's updates per second (goal <= 10).

    python bench/ui_flood.py [--lines 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from cmlcluster import Session
from cmlcluster.events import OutputLine

FLOOD = """
import cmlcluster
for i in range({lines}):
    print("line", i)
    if i % 1000 == 0:
        cmlcluster.report(i, {lines}, loss=1.0 / (i + 1))
print("done")
"""


def job(lines: int, with_widget: bool) -> tuple[float, float]:
    """Seconds from launch until the last line arrived; the widget's updates a second (0 without)."""
    with Session("local", echo=False) as session:
        done = threading.Event()
        session.subscribe(lambda e: done.set() if isinstance(e, OutputLine) and e.text == "done" else None)
        view = None
        if with_widget:
            from cmlcluster.ui.widget import WidgetView

            view = WidgetView(session)
        before = view.updates if view else 0
        started = time.perf_counter()
        workers = session.launch_workers(1, cpu=1, memory=1, code=FLOOD.format(lines=lines))
        result = session.await_workers(workers, timeout_seconds=600)
        assert not result["failures"], result["failures"]
        assert done.wait(60)
        elapsed = time.perf_counter() - started
        rate = ((view.updates - before) / elapsed) if view else 0.0
    return elapsed, rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    plain, widget, rates = [], [], []
    for _ in range(args.repeat):
        plain.append(job(args.lines, with_widget=False)[0])
        seconds, rate = job(args.lines, with_widget=True)
        widget.append(seconds)
        rates.append(rate)
    p, w = statistics.median(plain), statistics.median(widget)
    print(f"{args.lines} lines, medians of {args.repeat}:")
    print(f"  without widget {p:.2f} s, with widget {w:.2f} s, ratio {w / p:.3f} (goal <= 1.05)")
    print(f"  widget updates/s: median {statistics.median(rates):.1f}, max {max(rates):.1f} (goal <= 10)")


if __name__ == "__main__":
    main()
