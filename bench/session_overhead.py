"""The session's own cost per worker, as the number of workers grows: launch -> all running, and one call_each
to all, on the fake backend (its control plane answers at once), so that only the session's machinery is
timed: its supervisor, event bus and subscribers (the session's record among them), on its loop and theirs.

The goal is a flat cost per worker: the ratio of a worker's cost at N to its cost at the smallest size, in the
same process. What a real worker adds (its process, its agent, the controller) is bench/scale.py's.

    python bench/session_overhead.py [--sizes 16 64 256 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from cmlcluster import Session
from cmlcluster.backends.fake import FakeBackend, FakeWorker


def measure(n: int, repeat: int) -> tuple[float, float]:
    """(launch -> all running, call_each to all): seconds, medians of `repeat`."""
    launches, calls = [], []
    for _ in range(repeat):
        with Session(FakeBackend(lambda i: FakeWorker()), echo=False) as session:
            t0 = time.perf_counter()
            ready = session.await_workers(session.launch_workers(n, cpu=0.1, memory=0.1), wait_for_completion=False)
            launches.append(time.perf_counter() - t0)
            assert len(ready["workers"]) == n, ready["failures"][:1]
            session._supervisor.control.responder = lambda engine_id, target, args: engine_id
            t0 = time.perf_counter()
            session.call_each([(w["id"], "os:getpid", ()) for w in ready["workers"]])
            calls.append(time.perf_counter() - t0)
    return statistics.median(launches), statistics.median(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    base: tuple[float, float] | None = None
    print(f"{'N':>5} {'launch':>9} {'per worker':>11} {'ratio':>6} {'call_each':>10} {'per call':>9} {'ratio':>6}")
    for n in args.sizes:
        launch, call = measure(n, args.repeat)
        per_launch, per_call = launch / n, call / n
        base = base or (per_launch, per_call)
        print(
            f"{n:>5} {launch * 1000:>7.1f}ms {per_launch * 1e6:>9.0f}us {per_launch / base[0]:>6.2f}"
            f" {call * 1000:>8.1f}ms {per_call * 1e6:>7.0f}us {per_call / base[1]:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
