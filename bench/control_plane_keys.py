"""What encrypting the control plane (CurveZMQ, cmlcluster/control/connection.py) costs: with against without.

Two measures, each alternating encrypted and plain sessions in this one process and printing the
ratio of medians (encrypted / plain; the goal is at most 1.05):

- launch: launch_workers(N) -> await_workers says every worker runs (local backend, cold session);
- flood: launch -> one worker has printed MB megabytes of 100-byte lines and the session has heard
  every one of them (await_workers(wait_for_completion=True), then every OutputLine delivered).

    python bench/control_plane_keys.py [--workers 4] [--mb 30] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cmlcluster import Session
from cmlcluster.control import connection
from cmlcluster.events import LinesDropped, OutputLine

FLOOD = "import sys\nline = 'x' * 99 + '\\n'\nfor _ in range({lines}):\n    sys.stdout.write(line)\n"


def launch(n: int) -> float:
    with Session("local", echo=False) as session:
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.5, memory=0.5)
        result = session.await_workers(workers, wait_for_completion=False, timeout_seconds=300)
        elapsed = time.perf_counter() - t0
        assert len(result["workers"]) == n, result["failures"]
    return elapsed


def flood(mb: int) -> float:
    lines = mb * 1_000_000 // 100
    with Session("local", echo=False) as session:
        heard = [0]  # every line the session heard: delivered, or counted as dropped for a slow subscriber
        session.subscribe(lambda e: heard.__setitem__(0, heard[0] + _lines(e)))
        t0 = time.perf_counter()
        [worker] = session.launch_workers(1, cpu=1, memory=1, code=FLOOD.format(lines=lines))
        result = session.await_workers([worker], wait_for_completion=True, timeout_seconds=600)
        session.drain()
        elapsed = time.perf_counter() - t0
        assert len(result["workers"]) == 1, result["failures"]
        assert heard[0] >= lines, f"{heard[0]} of {lines} lines arrived"
    return elapsed


def _lines(event: object) -> int:
    if isinstance(event, OutputLine):
        return 1
    return event.count if isinstance(event, LinesDropped) else 0


def measure(what, argument: int, repeat: int) -> tuple[float, float]:
    encrypted, plain = [], []
    for _ in range(repeat):
        for on, times in ((True, encrypted), (False, plain)):
            connection.ENCRYPT = on
            times.append(what(argument))
    connection.ENCRYPT = True
    return statistics.median(encrypted), statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mb", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'measure':<22} {'encrypted s':>12} {'plain s':>8} {'ratio':>6}  (medians of {args.repeat})")
    for name, what, argument in (
        (f"launch {args.workers} workers", launch, args.workers),
        (f"flood {args.mb} MB", flood, args.mb),
    ):
        on, off = measure(what, argument, args.repeat)
        print(f"{name:<22} {on:>12.2f} {off:>8.2f} {on / off:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
