"""Where a training worker's CPU goes: the agent's own threads, against the user's code and TensorFlow.

run_cluster's training runs in the worker's engine, beside the threads a worker started by hand does
not have: ipykernel's IOPub and Control threads, its two output-pipe readers, the engine's heartbeat
device, ZeroMQ's I/O thread and the agent's controller watch. This bench starts the cluster run_cluster
starts (2 workers + 1 ps, local), asks worker 0 for its Python threads before training, runs
worker_scripts/tf_ps_train.py on every worker, and reads worker 0's threads' CPU from
/proc/<pid>/task/*/stat over a window inside training, with the session's and the controller's CPU over
the same window. A worker started by hand is read the same way, for comparison.

    python bench/tf_worker_threads.py [--window 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")
STEPS = "100000"  # more than the window needs: the run is stopped once it is read


def python_threads() -> dict[int, str]:
    """Runs in the worker: its Python threads, by native thread id."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each thread of `pid`, with its kernel name."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        found[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return found


def by_group(pid: int, python: dict[int, str], window: float) -> dict[str, float]:
    before = thread_cpu(pid)
    time.sleep(window)
    after = thread_cpu(pid)
    groups: dict[str, float] = collections.defaultdict(float)
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if tid == pid:
            group = "main thread (training)"
        elif name.startswith("ZMQbg"):
            group = "ZeroMQ I/O"
        elif tid in python:
            group = f"Python: {python[tid]}"
        else:
            group = "TensorFlow (native)"
        groups[group] += used
    return dict(sorted(groups.items(), key=lambda item: -item[1]))


def descendants_cpu(kinds: dict[str, str]) -> dict[str, float]:
    """CPU seconds so far of this process and of its descendants whose command line holds a kind's mark."""
    me = psutil.Process()
    totals = {"session": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            for kind, mark in kinds.items():
                if mark in command:
                    totals[kind] = totals.get(kind, 0.0) + sum(child.cpu_times()[:2])
        except psutil.Error:
            continue
    return totals


def ours(window: float) -> tuple[dict[str, float], dict[str, float]]:
    from cmlcluster import Session, start_cluster

    with Session("local", echo=False) as session:
        cluster = start_cluster(
            n_workers=2,
            n_ps=1,
            cpu=os.cpu_count() or 1,
            memory=2,
            session=session,
            coordinator=False,
            env={"TRAIN_STEPS": STEPS},
        )
        worker = cluster.workers[0].worker_id
        python = session.call(worker, "tf_worker_threads:python_threads")
        pid = session.worker_pid(worker)
        assert pid is not None
        script = str(HERE.parent / "worker_scripts" / "tf_ps_train.py")

        def train() -> None:
            with contextlib.suppress(Exception):  # the cluster is stopped in mid-training
                cluster.run_cml_script(script)

        training = threading.Thread(target=train, daemon=True)
        training.start()
        while "global step" not in session.output(worker):
            time.sleep(0.2)
        others = descendants_cpu({"controller": "cmlcluster.control.controller"})
        groups = by_group(pid, python, window)
        after = descendants_cpu({"controller": "cmlcluster.control.controller"})
        cluster.stop()  # ends the training: its workers go
        return groups, {k: after[k] - others.get(k, 0.0) for k in after}


def by_hand(window: float) -> dict[str, float]:
    sys.path.insert(0, str(HERE))
    from tf_cluster import SCRIPT, hand_cluster

    os.environ["TRAIN_STEPS"] = STEPS
    processes, _ = hand_cluster(2, 1, [sys.executable, SCRIPT])
    try:
        worker = processes[1]
        assert worker.stdout is not None
        for line in worker.stdout:
            if "global step" in line:
                break
        return by_group(worker.pid, {}, window)
    finally:
        for p in processes:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    # Workers on this machine get the session's environment: they import python_threads from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    for _ in range(args.repeat):
        groups, others = ours(args.window)
        total = sum(groups.values())
        agent = sum(v for k, v in groups.items() if k.startswith("Python:") or k == "ZeroMQ I/O")
        print(
            f"run_cluster worker 0, {args.window:g} s inside training: {total:.2f} CPU s, of which the agent's "
            f"threads {agent:.3f} s ({agent / total:.1%}); session {others['session']:.2f} s, "
            f"controller {others.get('controller', 0.0):.2f} s",
            flush=True,
        )
        for group, used in groups.items():
            print(f"    {group}: {used:.2f}")
        hand = by_hand(args.window)
        print(
            f"by-hand worker 0: {sum(hand.values()):.2f} CPU s; " + ", ".join(f"{g} {u:.2f}" for g, u in hand.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
