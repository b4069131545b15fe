"""Repeated use of one session: does it stay as fast as it started?

Runs launch -> both succeeded -> stop cycles of 2 local workers in one session, and
the same cycles each in a fresh session, in the same process; then parallel calls
on 2 running workers. Prints the median cycle time of the last tenth of the
long-lived session's cycles against its first tenth (1.0: no slowdown; the stall
this guards against showed up as a 40 s timeout per cycle), the long-lived session
against fresh sessions, and the median call round trip of the last tenth of the
calls against the first tenth.

    python bench/repeated_use.py [--cycles 100] [--fresh 10] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cmlcluster import Session


def cycle(session: Session) -> float:
    t0 = time.perf_counter()
    workers = session.launch_workers(n=2, cpu=0.5, memory=0.5, code="print('x')")
    result = session.await_workers(workers, timeout_seconds=60)
    assert result["failures"] == [], result["failures"]
    session.stop_workers()
    return time.perf_counter() - t0


def tenths(times: list[float]) -> tuple[float, float]:
    k = max(1, len(times) // 10)
    return statistics.median(times[:k]), statistics.median(times[-k:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--fresh", type=int, default=10)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    with Session("local", echo=False) as session:
        long_lived = [cycle(session) for _ in range(args.cycles)]
    fresh = []
    for _ in range(args.fresh):
        with Session("local", echo=False) as session:
            cycle(session)  # the first cycle also starts the controller: not counted
            fresh.append(cycle(session))
    first, last = tenths(long_lived)
    print(
        f"cycles in one session: {args.cycles}, median first tenth {first:.2f} s, last tenth {last:.2f} s, "
        f"ratio last/first {last / first:.2f}"
    )
    print(
        f"one session vs fresh sessions (second cycle of each, medians): "
        f"{statistics.median(long_lived):.2f} s vs {statistics.median(fresh):.2f} s, "
        f"ratio {statistics.median(long_lived) / statistics.median(fresh):.2f}"
    )

    with Session("local", echo=False) as session:
        workers = session.launch_workers(n=2, cpu=0.5, memory=0.5)
        session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
        rounds = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            session.call_each([(w, "os:getpid", ()) for w in workers], timeout=30)
            rounds.append(time.perf_counter() - t0)
    first, last = tenths(rounds)
    print(
        f"parallel calls on 2 workers: {args.calls} rounds, median first tenth {first * 1000:.1f} ms, "
        f"last tenth {last * 1000:.1f} ms, ratio last/first {last / first:.2f}"
    )


if __name__ == "__main__":
    main()
