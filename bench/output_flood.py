"""A program that prints for a long time: the notebook process's memory and a call's latency.

One local worker prints N lines of 97 bytes, then (but in the last run) a "\\r" progress bar
of N/100 states, each flushed. The session's process memory (VmRSS) is read before and after,
and a call to a second, idle worker (os:getpid) is timed every second while the first prints: its
reply shares the client's one IO thread, and the session's event loop, with the output. The worst latency is
given for the first and the last tenth of the run: flat is the goal.

Baselines, in the same process: the client keeping each running program's whole output, as
ipyparallel does by itself (it copies that output on every message, so keep its N small); and
output relayed to the session's loop one callback per message, as before lines.OutputRelay.

    python bench/output_flood.py [--lines 1000000] [--baseline-lines 200000]
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from unittest import mock

from cmlcluster import Session, lines
from cmlcluster.control import ipyparallel_internals

PRINTER = """
import sys
for i in range({lines}):
    print(f"{{i:>12}} " + "x" * 84)
for i in range({bar_states}):
    sys.stdout.write(f"\\rstep {{i}}")
    sys.stdout.flush()  # as a progress bar does on each update
print()
"""


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def flood(lines: int, bar: bool = True) -> tuple[float, float, float, float]:
    """(seconds to print it all, MiB the session grew, worst call latency in s in the first and
    the last tenth of the run)."""
    with Session("local", echo=False) as session:
        [warm] = session.launch_workers(1, cpu=1, memory=1)  # idle: answers calls
        session.await_workers([warm], wait_for_completion=False, timeout_seconds=120)
        before = rss_mib()
        t0 = time.perf_counter()
        printer = PRINTER.format(lines=lines, bar_states=lines // 100 if bar else 0)
        [worker] = session.launch_workers(1, cpu=1, memory=1, code=printer)
        latencies: list[tuple[float, float]] = []  # (when it was asked, seconds to its reply)
        done = threading.Event()

        def probe() -> None:
            while not done.wait(1.0):
                started = time.perf_counter()
                try:
                    session.call(warm, "os:getpid", timeout=60)
                except Exception as e:
                    print(f"call failed: {e}")
                    return
                latencies.append((started, time.perf_counter() - started))

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        result = session.await_workers([worker], timeout_seconds=3600)
        elapsed = time.perf_counter() - t0
        done.set()
        prober.join()
        assert [w["status"] for w in result["workers"]] == ["succeeded"], result
        grown = rss_mib() - before
    tenth = elapsed / 10
    first = max((s for t, s in latencies if t < t0 + tenth), default=0.0)
    last = max((s for t, s in latencies if t > t0 + elapsed - tenth), default=0.0)
    return elapsed, grown, first, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--baseline-lines", type=int, default=200_000)
    args = parser.parse_args()
    print(
        f"{'run':<32} {'lines':>9} {'MB printed':>10} {'seconds':>8} {'RSS grew MiB':>12} "
        f"{'worst call s: first tenth':>25} {'last tenth':>10}"
    )
    keeping = mock.patch.object(ipyparallel_internals, "forget_stream_text", lambda *a: None)
    per_message = mock.patch.object(lines.OutputRelay, "put", one_callback_per_message)
    for name, n, baseline, bar in (
        ("shipped", args.baseline_lines, None, True),
        ("client keeps output", args.baseline_lines, keeping, True),
        ("one loop callback per message", args.lines, per_message, True),
        ("shipped", args.lines, None, True),
        ("shipped, no progress bar", args.lines, None, False),
    ):
        with baseline or contextlib.nullcontext():
            elapsed, grown, first, last = flood(n, bar)
        printed = n * 98 / 1e6
        print(f"{name:<32} {n:>9} {printed:>10.1f} {elapsed:>8.1f} {grown:>12.1f} {first:>25.2f} {last:>10.2f}")


def one_callback_per_message(relay: lines.OutputRelay, stream: str, text: str) -> None:
    relay._loop.call_soon_threadsafe(relay._on_output, stream, text)


if __name__ == "__main__":
    main()
