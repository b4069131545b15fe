"""Launch -> all running, for N local workers: cmlcluster against ipyparallel's own Cluster.

Both start cold (controller, then N engines, until every engine is connected)
in the same process, alternating, and the ratio of medians is printed
(ours / ipyparallel). cmlcluster also learns each worker's address before it
calls it running; ipyparallel's figure is start_and_connect_sync() with n=N. A third column:
cmlcluster with workers started on their own, not forked from a template (LocalBackend(fork=False)).

    python bench/launch.py [--sizes 1 4 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ipyparallel as ipp

from cmlcluster import Session
from cmlcluster.backends.local import LocalBackend


def ours(n: int, fork: bool = True) -> float:
    with Session(LocalBackend(fork=fork), echo=False) as session:
        t0 = time.perf_counter()
        # cpu=1: a smaller quota really throttles the engine (cgroups), which the baseline is not.
        workers = session.launch_workers(n, cpu=1, memory=1)
        result = session.await_workers(workers, wait_for_completion=False, timeout_seconds=300)
        elapsed = time.perf_counter() - t0
        assert len(result["workers"]) == n, result["failures"]
    return elapsed


def baseline(n: int) -> float:
    cluster = ipp.Cluster(n=n, log_level=40)
    t0 = time.perf_counter()
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(n, timeout=300)
    elapsed = time.perf_counter() - t0
    client.close()
    cluster.stop_cluster_sync()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'N':>3} {'cmlcluster s':>13} {'ipyparallel s':>14} {'ratio':>6} {'not forked s':>13} {'ratio':>6}"
        f"  (medians of {args.repeat})"
    )
    for n in args.sizes:
        mine, theirs, unforked = [], [], []
        for _ in range(args.repeat):
            mine.append(ours(n))
            theirs.append(baseline(n))
            unforked.append(ours(n, fork=False))
        m, t, u = statistics.median(mine), statistics.median(theirs), statistics.median(unforked)
        print(f"{n:>3} {m:>13.2f} {t:>14.2f} {m / t:>6.2f} {u:>13.2f} {u / t:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
