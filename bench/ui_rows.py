"""What a view's render costs as its workers grow: 16 rows against 1,024 (issue 38: at 1,024 real workers the
widget fell to 5.5 updates/s, 21 ms a render). Workers past a screenful are one line by status (the table
shows TABLE_ROWS), so a render should cost about the same at any count.

The views are fed the events real workers cause (a status each, a resource sample each, and with --printing
a few lines of output each, as ranks: 1,024 sources for the output's picker), without workers:
what is measured is the render, in this process. Printed: the median render (ms) at each size and their
ratio (goal <= 10: what still grows with the rows is their records' sort and count; the issue's goal is
10 ms at 1,024 rows), and the size of the table's HTML that each render sends to the browser.

    python bench/ui_rows.py [--small 16] [--large 1024] [--renders 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cmlcluster import Session
from cmlcluster.events import CallStarted, OutputLine, ResourceUse, WorkerStatus
from cmlcluster.ui.widget import SessionViews, WidgetView
from cmlcluster.workers import Status, WorkerSnapshot


def median_render(rows: int, renders: int, printing: bool = False) -> tuple[float, int]:
    """The median seconds of one render of a view of `rows` running workers, and its table's HTML size."""
    with Session("fake", echo=False) as session:
        views = SessionViews.of(session)
        view = WidgetView(session, views, views.router.open_call("call", "launch_workers"), "call")
        with views.lock:
            views.views.append(view)
            views.latest = view
        session.publish(CallStarted("call", "launch_workers"))
        for i in range(rows):
            worker = f"{session.id}-{i}"
            snapshot = WorkerSnapshot(worker, Status.RUNNING, running_at=time.time(), cpu=1, ip_address="10.0.0.1")
            session.publish(WorkerStatus(snapshot))
            session.publish(ResourceUse(worker, 95.0, 1 << 30, 2 << 30))
            for line in range(5 if printing else 0):
                session.publish(OutputLine(f"rank {i}", "stdout", f"line {line}"))  # a source of its own each
        session.drain()
        times = []
        for _ in range(renders):
            view.stale()
            started = time.perf_counter()
            view._render()
            times.append(time.perf_counter() - started)
        return statistics.median(times), len(view.table.value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=16)
    parser.add_argument("--large", type=int, default=1024)
    parser.add_argument("--renders", type=int, default=50)
    parser.add_argument("--printing", action="store_true", help="every worker also printed a few lines")
    args = parser.parse_args()
    small, small_html = median_render(args.small, args.renders, args.printing)
    large, large_html = median_render(args.large, args.renders, args.printing)
    print(f"{args.small:>5} rows: render {small * 1000:.2f} ms, table {small_html:,} characters")
    print(f"{args.large:>5} rows: render {large * 1000:.2f} ms, table {large_html:,} characters")
    print(f"ratio {large / small:.2f} (goal <= 10)")


if __name__ == "__main__":
    main()
