"""What many views cost: a notebook that ran many cells has a view per call, all alive with the session.

One local worker prints N lines (default 50,000) while the session has 1 view, then while it has 40
(39 earlier calls' views with their own finished workers' rows, and the current one), alternating in the
same process. Printed: the job's medians and their ratio (goal <= 1.05: earlier views cost the flood
nothing), and the median time of one pass of the render thread over all views (each view checks whether
its model moved; only the current one draws).

    python bench/ui_views.py [--lines 50000] [--views 40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from cmlcluster import Session
from cmlcluster.events import CallStarted, OutputLine, WorkerStatus
from cmlcluster.ui.widget import SessionViews, WidgetView
from cmlcluster.workers import Status, WorkerSnapshot

FLOOD = """
for i in range({lines}):
    print("line", i)
print("done")
"""


def open_view(session: Session, views: SessionViews, call: str) -> WidgetView:
    """A call's view, as SessionViews.show_call makes it in a kernel (here there is none to display in)."""
    view = WidgetView(session, views, views.router.open_call(call, "launch_workers"), call)
    with views.lock:
        views.views.append(view)
        views.latest = view
    session.publish(CallStarted(call, "launch_workers"))
    return view


def job(lines: int, n_views: int) -> tuple[float, float]:
    """Seconds from launch until the last line arrived, and the median pass over all views (ms)."""
    with Session("local", echo=False) as session:
        views = SessionViews.of(session)
        for i in range(n_views - 1):  # earlier calls: a finished worker's row each
            open_view(session, views, f"earlier-{i}")
            session.publish(WorkerStatus(WorkerSnapshot(f"{session.id}-{1000 + i}", Status.SUCCEEDED, cpu=1)))
        open_view(session, views, "current")
        passes: list[float] = []
        render_all = views._render_all

        def timed(uptimes: bool) -> None:
            t = time.perf_counter()
            render_all(uptimes)
            passes.append(time.perf_counter() - t)

        views._render_all = timed  # type: ignore[method-assign]
        done = threading.Event()
        session.subscribe(lambda e: done.set() if isinstance(e, OutputLine) and e.text == "done" else None)
        started = time.perf_counter()
        workers = session.launch_workers(1, cpu=1, memory=1, code=FLOOD.format(lines=lines))
        result = session.await_workers(workers, timeout_seconds=600)
        assert not result["failures"], result["failures"]
        assert done.wait(60)
        elapsed = time.perf_counter() - started
    return elapsed, 1000 * statistics.median(passes or [0.0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--views", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    one, many, pass_one, pass_many = [], [], [], []
    for _ in range(args.repeat):
        seconds, ms = job(args.lines, 1)
        one.append(seconds)
        pass_one.append(ms)
        seconds, ms = job(args.lines, args.views)
        many.append(seconds)
        pass_many.append(ms)
    a, b = statistics.median(one), statistics.median(many)
    print(f"{args.lines} lines, medians of {args.repeat}:")
    print(f"  1 view {a:.2f} s, {args.views} views {b:.2f} s, ratio {b / a:.3f} (goal <= 1.05)")
    print(
        f"  a render pass over all views: {statistics.median(pass_one):.2f} ms with 1, "
        f"{statistics.median(pass_many):.2f} ms with {args.views}"
    )


if __name__ == "__main__":
    main()
