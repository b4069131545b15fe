"""What the agents' resource sampling costs (cmlcluster/usage.py): N local workers with sampling on (every
2 s, the default) against the same N with it off (CMLCLUSTER_USAGE_SECONDS=0, through env=), in one
process, on and off alternating (and which goes first alternating round by round):

- launch -> every worker running (await_workers(wait_for_completion=False)), a new session each time;
- then, the workers idle and sampling, for IDLE_SECONDS: the round trip of one small call to every worker
  at once (call_each os:getpid, its median and worst of CALL_ROUNDS), of one call to one worker (median and
  worst of SINGLE_CALLS, a stall shows as its worst), the CPU of the workers' processes together and of the
  session's process (% of one core), and the ResourceUse events the session published (about N / 2 a
  second when on: proof that it was).

Ratios are on / off: of the medians, and "paired", the median of each round's own ratio.

    python bench/resource_sampling.py [--workers 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

import psutil

from cmlcluster import Session
from cmlcluster.events import ResourceUse

IDLE_SECONDS = 6.0
CALL_ROUNDS = 10
SINGLE_CALLS = 40
SAMPLING = {"on": {"CMLCLUSTER_USAGE_SECONDS": "2"}, "off": {"CMLCLUSTER_USAGE_SECONDS": "0"}}


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def one_round(n: int, mode: str) -> dict[str, float]:
    me = psutil.Process()
    with Session("local", echo=False) as session:
        samples = 0

        def count(event: Any) -> None:
            nonlocal samples
            samples += isinstance(event, ResourceUse)

        session.subscribe(count)
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.25, memory=0.25, env=SAMPLING[mode])
        ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=600)
        launch = time.perf_counter() - t0
        assert len(ready["workers"]) == n, ready["failures"]
        time.sleep(2.5)  # past every sampler's first wait: samples flow from here on
        agents = [psutil.Process(pid) for pid in (session.worker_pid(w) for w in workers) if pid]
        session.drain()
        counted, cpu_workers, cpu_session, t1 = samples, cpu_seconds(agents), cpu_seconds([me]), time.perf_counter()
        all_calls: list[float] = []
        single: list[float] = []
        done = threading.Event()

        def single_calls() -> None:
            target = workers[0]
            while len(single) < SINGLE_CALLS and not done.is_set():
                t = time.perf_counter()
                session.call(target, "os:getpid", timeout=60)
                single.append(time.perf_counter() - t)
                time.sleep(IDLE_SECONDS / SINGLE_CALLS / 2)

        prober = threading.Thread(target=single_calls)
        prober.start()
        for _ in range(CALL_ROUNDS):
            t = time.perf_counter()
            pids = session.call_each([(w, "os:getpid", ()) for w in workers], timeout=60)
            all_calls.append(time.perf_counter() - t)
            assert len(set(pids)) == n
            time.sleep(max(0.0, IDLE_SECONDS / CALL_ROUNDS - all_calls[-1]))
        prober.join()
        done.set()
        elapsed = time.perf_counter() - t1
        session.drain()
        figures = {
            "launch": launch,
            "call_each_ms": 1000 * statistics.median(all_calls),
            "call_each_worst_ms": 1000 * max(all_calls),
            "call_ms": 1000 * statistics.median(single),
            "call_worst_ms": 1000 * max(single),
            "workers_cpu": 100 * (cpu_seconds(agents) - cpu_workers) / elapsed,
            "session_cpu": 100 * (cpu_seconds([me]) - cpu_session) / elapsed,
            "samples_per_s": (samples - counted) / elapsed,
        }
    return figures


COLUMNS = (
    ("launch", "launch s", "{:.2f}"),
    ("call_each_ms", "call_each ms", "{:.0f}"),
    ("call_each_worst_ms", "worst", "{:.0f}"),
    ("call_ms", "one call ms", "{:.1f}"),
    ("call_worst_ms", "worst", "{:.0f}"),
    ("workers_cpu", "workers %", "{:.1f}"),
    ("session_cpu", "session %", "{:.1f}"),
    ("samples_per_s", "samples/s", "{:.1f}"),
)


def line(label: str, figures: dict[str, float]) -> str:
    cells = [f"{header}={fmt.format(figures[key])}" for key, header, fmt in COLUMNS]
    return f"{label:>10}  " + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n = args.workers
    print(
        f"{os.cpu_count()} cores, {n} local workers, sampling on (every 2 s) and off alternating, {args.repeat} rounds"
    )
    one_round(2, "on"), one_round(2, "off")  # warm: imports and first-use costs are no round's
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for r in range(args.repeat):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            runs[mode].append(one_round(n, mode))
            print(line(f"{r + 1} {mode}", runs[mode][-1]), flush=True)
    medians = {mode: {k: statistics.median(x[k] for x in runs[mode]) for k in runs[mode][0]} for mode in runs}
    print(line("median on", medians["on"]))
    print(line("median off", medians["off"]))
    for key, label in (("launch", "launch"), ("call_each_ms", "call to all"), ("call_worst_ms", "worst single call")):
        paired = statistics.median(a[key] / b[key] for a, b in zip(runs["on"], runs["off"], strict=True))
        spread = max(b[key] for b in runs["off"]) / min(b[key] for b in runs["off"])
        print(
            f"{label}: on / off {medians['on'][key] / medians['off'][key]:.2f} (paired {paired:.2f}; "
            f"off's spread {spread:.2f})"
        )


if __name__ == "__main__":
    main()
