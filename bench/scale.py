"""How the cost grows with the number of local workers, up to 64 on this machine.

For each size N (default 8, 16, 32, 64), in one process, alternating sizes round by round:

- launch -> every worker running (await_workers(wait_for_completion=False)), and that time per worker;
  the figure to watch is the cost per worker at the largest N against the smallest (goal <= 1.2: flat);
- with N idle workers, over IDLE_SECONDS: the controller's CPU (% of one core) and the notebook process's
  own, per worker; the notebook process's memory growth per worker (RSS after the launch, against
  before the session);
- list_workers() (median of 200) and one call to every worker at once (call_each, median of 10);
- the widget (WidgetView, as in a notebook) with N rows while every worker prints PRINT_RATE lines a
  second: its updates a second (capped at 10) and the time one render takes (median and worst).

    python bench/scale.py [--sizes 8 16 32 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import psutil

from cmlcluster import Session
from cmlcluster.ui.widget import WidgetView

IDLE_SECONDS = 5.0
PRINT_SECONDS = 8.0
PRINT_RATE = 20  # lines a second per worker while the widget is measured
CONTROLLER = ["-m", "cmlcluster.control.controller"]
PRINTING = f"""
import time
for i in range({int(PRINT_SECONDS * PRINT_RATE)}):
    print("line", i, flush=True)
    time.sleep({1 / PRINT_RATE})
"""


def controller_processes() -> list[psutil.Process]:
    """The session's controller and what it forked (its schedulers)."""
    [top] = [p for p in psutil.Process().children() if p.cmdline()[1:3] == CONTROLLER]
    return [top, *top.children(recursive=True)]


def cpu_percent(processes: list[psutil.Process], seconds: float) -> float:
    """Of one core, over `seconds` (user + system), of these processes together."""

    def used() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    before = used()
    time.sleep(seconds)
    return 100 * (used() - before) / seconds


def idle_figures(n: int) -> dict[str, float]:
    """Launch n idle workers; time it, then what they cost while idle, and the session's calls."""
    me = psutil.Process()
    rss_before = me.memory_info().rss
    with Session("local", echo=False) as session:
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.25, memory=0.25)  # no program: the engine answers calls
        ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=600)
        launch = time.perf_counter() - t0
        assert len(ready["workers"]) == n, ready["failures"]
        time.sleep(1)  # the last registrations' echoes settle
        rss = me.memory_info().rss - rss_before
        controller = controller_processes()
        box: dict[str, float] = {}
        measure = threading.Thread(target=lambda: box.update(controller=cpu_percent(controller, IDLE_SECONDS)))
        measure.start()
        box["session"] = cpu_percent([me], IDLE_SECONDS)
        measure.join()
        listing = []
        for _ in range(200):
            t = time.perf_counter()
            assert len(session.list_workers()) == n
            listing.append(time.perf_counter() - t)
        calls = []
        for _ in range(10):
            t = time.perf_counter()
            pids = session.call_each([(w, "os:getpid", ()) for w in workers], timeout=60)
            calls.append(time.perf_counter() - t)
            assert len(set(pids)) == n
    return {
        "launch": launch,
        "rss_mb": rss / 2**20,
        "controller_cpu": box["controller"],
        "session_cpu": box["session"],
        "list_ms": 1000 * statistics.median(listing),
        "call_each_ms": 1000 * statistics.median(calls),
    }


def widget_figures(n: int) -> dict[str, float]:
    """n workers printing while a WidgetView renders them: its updates a second and render times."""
    with Session("local", echo=False) as session:
        view = WidgetView(session)
        renders: list[float] = []
        render = view._render  # the render thread calls it through the instance: time each call

        def timed() -> None:
            t = time.perf_counter()
            render()
            renders.append(time.perf_counter() - t)

        view._render = timed  # type: ignore[method-assign]
        workers = session.launch_workers(n, cpu=0.25, memory=0.25, code=PRINTING)
        session.await_workers(workers, wait_for_completion=False, timeout_seconds=600)
        before, t0, renders[:] = view.updates, time.perf_counter(), []
        time.sleep(PRINT_SECONDS / 2)
        rate = (view.updates - before) / (time.perf_counter() - t0)
        timings = list(renders)
        session.await_workers(workers, timeout_seconds=600)
    return {
        "updates_per_s": rate,
        "render_ms": 1000 * statistics.median(timings),
        "render_worst_ms": 1000 * max(timings),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; medians of {args.repeat} rounds, sizes alternating within each round")
    idle_figures(2), widget_figures(2)  # warm: imports and first-use costs are no worker's
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in args.sizes}
    for _ in range(args.repeat):
        for n in args.sizes:
            runs[n].append({**idle_figures(n), **widget_figures(n)})
    header = (
        f"{'N':>3} {'launch s':>9} {'per worker ms':>14} {'RSS MB/worker':>14} {'controller %/worker':>20} "
        f"{'session %/worker':>17} {'list ms':>8} {'call_each ms':>13} {'widget upd/s':>13} "
        f"{'render ms':>10} {'worst ms':>9}"
    )
    print(header)
    per_worker = {}
    for n in args.sizes:
        m = {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]}
        per_worker[n] = m["launch"] / n
        print(
            f"{n:>3} {m['launch']:>9.2f} {1000 * per_worker[n]:>14.1f} {m['rss_mb'] / n:>14.2f} "
            f"{m['controller_cpu'] / n:>20.3f} {m['session_cpu'] / n:>17.3f} {m['list_ms']:>8.2f} "
            f"{m['call_each_ms']:>13.1f} {m['updates_per_s']:>13.1f} {m['render_ms']:>10.2f} "
            f"{m['render_worst_ms']:>9.1f}"
        )
    small, large = min(args.sizes), max(args.sizes)
    spread = [r["launch"] / large / (s["launch"] / small) for r, s in zip(runs[large], runs[small], strict=True)]
    print(
        f"launch cost per worker at {large} against {small}: {per_worker[large] / per_worker[small]:.2f} "
        f"(rounds: {', '.join(f'{x:.2f}' for x in spread)}; goal <= 1.2)"
    )


if __name__ == "__main__":
    main()
