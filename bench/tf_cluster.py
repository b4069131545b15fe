"""TensorFlow clusters: training throughput and time to ready, against servers started by hand.

1. Steps per second of the same parameter-server training (worker_scripts/tf_ps_train.py,
   2 workers + 1 ps, asynchronous SGD), through run_cluster(worker_script=...) and through
   processes started by hand with hand-written TF_CONFIG. Throughput is the
   cluster's steps over the span from the first worker's first step to the last worker's last,
   as the script itself reports them (a sum of per-worker rates is not a throughput: a worker
   that joins late does a step or two in milliseconds, and its "rate" swamped the sum).
   Goal: ratio (ours / by hand) >= 0.97.
2. Call -> every server accepting connections for 4 workers + 2 ps, and for 1 worker:
   start_cluster against processes started by hand in parallel, each starting its
   tf.distribute.Server. Beside the times, the CPU seconds each side used (this process and
   its descendants): where the CPU ratio is the time ratio, the machine's cores were the
   limit, not waiting. One worker is bound by latency, as six are on a machine with cores
   to spare.

Both sides run in this process's run, alternating (interleaved repeats), on this machine's local
processes. Call -> ready also runs a third side: start_cluster with workers started on their own
rather than forked from a template agent (agent/template.py), which shows what the template
saves. Beside each ratio: the by-hand runs' spread (slowest / fastest), the noise a gap must
exceed to be real.

    python bench/tf_cluster.py [--steps 3000] [--repeat 5] [--only training|ready]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from timeline import Timeline, median_timeline  # bench/, the script's folder

from cmlcluster import Session, run_cluster, start_cluster
from cmlcluster.backends.local import LocalBackend
from cmlcluster.ports import free_ports

SCRIPT = str(Path(__file__).resolve().parents[1] / "worker_scripts" / "tf_ps_train.py")
# The processes started by hand have no CPU quota; giving ours the whole machine keeps the
# comparison about cmlcluster, not about the cgroup quota a smaller cpu= would set.
CPUS = os.cpu_count() or 1
BENCH_LINE = re.compile(r"cmlcluster-bench steps=(\d+) seconds=[\d.]+ from=([\d.]+) to=([\d.]+)")


def throughput(text: str) -> float:
    """The cluster's steps per second, from the workers' bench lines."""
    lines = [(int(steps), float(start), float(end)) for steps, start, end in BENCH_LINE.findall(text)]
    if len(lines) < 2:
        raise RuntimeError(f"expected a bench line from each worker, got:\n{text}")
    span = max(end for _, _, end in lines) - min(start for _, start, _ in lines)
    return sum(steps for steps, _, _ in lines) / span


def hand_cluster(n_workers: int, n_ps: int, command: list[str]) -> tuple[list[subprocess.Popen[str]], dict]:
    ports = free_ports(n_workers + n_ps)
    spec = {
        "ps": [f"127.0.0.1:{p}" for p in ports[:n_ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[n_ps:]],
    }
    processes = []
    for job in ("ps", "worker"):
        for index in range(len(spec[job])):
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": job, "index": index}}))
            processes.append(
                subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
    return processes, spec


def training_ours(steps: int) -> float:
    os.environ["TRAIN_STEPS"] = str(steps)
    with Session("local", echo=False) as session:
        run_cluster(n_workers=2, n_ps=1, cpu=CPUS, memory=2, worker_script=SCRIPT, session=session)
        return throughput("\n".join(session.output(w) for w in session.list_workers()))


def training_by_hand(steps: int) -> float:
    os.environ["TRAIN_STEPS"] = str(steps)
    processes, _ = hand_cluster(2, 1, [sys.executable, SCRIPT])
    ps, workers = processes[0], processes[1:]
    outputs = [w.communicate()[0] for w in workers]
    ps.kill()
    ps.wait()
    return throughput("\n".join(outputs))


SERVE = (
    "import json, os, tensorflow as tf; c = json.loads(os.environ['TF_CONFIG']); "
    "s = tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), job_name=c['task']['type'], "
    "task_index=c['task']['index'], protocol='grpc'); s.join()"
)


def cpu_seconds() -> float:
    """CPU time used so far by this process and its living descendants."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for process in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(process.cpu_times()[:2])
    return total


def ready_ours(n_workers: int, n_ps: int, fork: bool = True) -> tuple[float, float, Timeline]:
    with Session(LocalBackend(fork=fork), echo=False) as session:
        timeline = Timeline().follow(session)
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        start_cluster(n_workers=n_workers, n_ps=n_ps, cpu=CPUS, memory=2, coordinator=False, session=session)
        timeline.mark("start_cluster returned")
        return time.perf_counter() - t0, cpu_seconds() - cpu0, timeline


def ready_by_hand(n_workers: int, n_ps: int) -> tuple[float, float, Timeline]:
    timeline = Timeline()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    processes, spec = hand_cluster(n_workers, n_ps, [sys.executable, "-c", SERVE])
    timeline.mark("processes started")
    try:
        for address in spec["ps"] + spec["worker"]:
            host, port = address.split(":")
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.05)
            timeline.mark("every server answering", last=True)
        return time.perf_counter() - t0, cpu_seconds() - cpu0, timeline
    finally:
        for p in processes:
            p.kill()
            p.wait()


def measure_training(steps: int, repeat: int) -> None:
    mine, theirs = [], []
    for _ in range(repeat):
        mine.append(training_ours(steps))
        theirs.append(training_by_hand(steps))
    m, t = statistics.median(mine), statistics.median(theirs)
    # Each run beside the next: the machine's load drifts, and a pair shares most of it.
    paired = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    print(f"  run_cluster: {' '.join(f'{x:.0f}' for x in mine)}; by hand: {' '.join(f'{x:.0f}' for x in theirs)}")
    print(
        f"training steps/s, 2 workers + 1 ps, {repeat} repeats: run_cluster {m:.0f}, by hand {t:.0f}, "
        f"ratio {m / t:.3f}, median of paired ratios {paired:.3f} (goal >= 0.97); "
        f"by-hand spread {max(theirs) / min(theirs):.3f}",
        flush=True,
    )


def measure_ready(n_workers: int, n_ps: int, repeat: int) -> None:
    mine, theirs, unforked, mine_cpu, theirs_cpu, unforked_cpu = [], [], [], [], [], []
    timelines: dict[str, list[Timeline]] = {"ours": [], "by hand": []}
    for _ in range(repeat):
        seconds, cpu, timeline = ready_ours(n_workers, n_ps)
        mine.append(seconds)
        mine_cpu.append(cpu)
        timelines["ours"].append(timeline)
        seconds, cpu, timeline = ready_by_hand(n_workers, n_ps)
        theirs.append(seconds)
        theirs_cpu.append(cpu)
        timelines["by hand"].append(timeline)
        seconds, cpu, _ = ready_ours(n_workers, n_ps, fork=False)
        unforked.append(seconds)
        unforked_cpu.append(cpu)
    m, t = statistics.median(mine), statistics.median(theirs)
    m_cpu, t_cpu = statistics.median(mine_cpu), statistics.median(theirs_cpu)
    paired = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    print(f"  start_cluster: {' '.join(f'{x:.2f}' for x in mine)}; by hand: {' '.join(f'{x:.2f}' for x in theirs)}")
    print(
        f"call -> ready, {n_workers} workers + {n_ps} ps, {repeat} repeats: start_cluster {m:.2f} s, "
        f"by hand {t:.2f} s, ratio {m / t:.2f}, median of paired ratios {paired:.2f} "
        f"(goal <= {1.10 if n_workers + n_ps > 1 else 1.15}); "
        f"by-hand spread {max(theirs) / min(theirs):.2f}; "
        f"CPU {m_cpu:.1f} s against {t_cpu:.1f} s, ratio {m_cpu / t_cpu:.2f} ({os.cpu_count()} cores)",
        flush=True,
    )
    u, u_cpu = statistics.median(unforked), statistics.median(unforked_cpu)
    print(
        f"  workers started on their own, not forked from a template (LocalBackend(fork=False)): {u:.2f} s, "
        f"ratio {u / t:.2f}, paired {statistics.median(a / b for a, b in zip(unforked, theirs, strict=True)):.2f}; "
        f"CPU {u_cpu:.1f} s, ratio {u_cpu / t_cpu:.2f}",
        flush=True,
    )
    print("  median timelines, seconds from the call:")
    for side, runs in timelines.items():
        print(median_timeline(runs).format(side), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=["training", "ready"])
    args = parser.parse_args()
    if args.only != "ready":
        measure_training(args.steps, args.repeat)
    if args.only != "training":
        measure_ready(4, 2, args.repeat)  # on few cores, bound by CPU
        measure_ready(1, 0, args.repeat)  # bound by latency, as on a machine with cores to spare


if __name__ == "__main__":
    main()
