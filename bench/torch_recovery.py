"""An elastic PyTorch run (run_torch's max_restarts) that loses a worker: the time from the kill to
training again, beside a fresh start of the same job, in one run.

Each repeat, in a session whose controller already runs: run_torch of the example on two nodes with
max_restarts=1; the fresh start is run_torch's call to rank 0's first epoch (launching two workers,
torchrun, the rendezvous, the ranks' start). After rank 0's second epoch the chosen node's worker is
killed (kill -9 of its agent; `docker kill` of its container); recovery is the kill to rank 0's next
epoch (the lost node dropped from the rendezvous, a worker launched in its place, the rendezvous
again, every rank started again, the snapshot sent to the replacement, one epoch).

    python bench/torch_recovery.py [--backend local|docker] [--node 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

from cmlcluster import Session, run_torch
from cmlcluster.events import Progress

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "worker_scripts" / "torch_ddp_train.py")
IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")


def kill(session: Session, worker_id: str) -> None:
    """kill -9 the worker: its container, or the agent above its node's torchrun (found by the agent's
    environment, which torchrun started with)."""
    if session.backend.name == "docker":
        import docker

        docker.from_env().containers.get(f"cmlcluster-{worker_id}").kill("SIGKILL")
        return
    for p in psutil.process_iter():
        try:
            if "cmlcluster.pytorch.launch" in p.cmdline() and p.environ().get("CDSW_ENGINE_ID") == worker_id:
                agent = next(a for a in p.parents() if "cmlcluster.agent" in a.cmdline())
                os.kill(agent.pid, signal.SIGKILL)
                return
        except (psutil.Error, StopIteration):
            continue
    raise RuntimeError(f"worker {worker_id}'s torchrun not found")


def once(backend: object, node: int) -> tuple[float, float]:
    """(fresh start, recovery) in seconds."""
    with Session(backend, echo=False) as session:
        warm = session.launch_workers(1, 0.5, 0.5)  # the controller up first: the start measured is the run's
        session.await_workers(warm, wait_for_completion=False, timeout_seconds=60)
        times: dict[str, float] = {}
        lock = threading.Lock()

        def kill_node() -> None:
            victim = session.list_workers()[1 + node]["id"]  # after the warm-up worker
            kill(session, victim)
            times["killed"] = time.monotonic()

        def on_event(event: object) -> None:
            if not (isinstance(event, Progress) and event.task == "rank 0"):
                return
            with lock:
                now = time.monotonic()
                times.setdefault("first", now)
                if event.step >= 2 and "killing" not in times:
                    times["killing"] = now
                    threading.Thread(target=kill_node, daemon=True).start()
                # An epoch that ended just before the kill may be told just after it.
                if "killed" in times and "again" not in times and now > times["killed"] + 0.5:
                    times["again"] = now

        session.subscribe(on_event)
        started = time.monotonic()
        result = run_torch(
            SCRIPT, ["--epochs", "30", "--samples", "8192"], nnodes=2, max_restarts=1, session=session, echo=False
        )
        if not (result.ok and result.restarts == 1):
            sys.exit(f"the run did not recover: {result.message}")
        return times["first"] - started, times["again"] - times["killed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="local", choices=["local", "docker"])
    parser.add_argument("--node", type=int, default=1, choices=[0, 1], help="the node whose worker is killed")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    backend: object = args.backend
    if args.backend == "docker":
        from cmlcluster.backends.docker.backend import DockerBackend

        backend = DockerBackend(image=IMAGE, host_python=True)
    fresh, recovery = [], []
    for _ in range(args.repeat):
        start, again = once(backend, args.node)
        fresh.append(start)
        recovery.append(again)
        print(f"fresh start to epoch 1: {start:5.1f} s   kill to the next epoch: {again:5.1f} s", flush=True)
    f, r = statistics.median(fresh), statistics.median(recovery)
    print(f"{args.backend}, node {args.node}'s worker killed: median fresh start {f:.1f} s, recovery {r:.1f} s")
    print(f"ratio (recovery / fresh start): {r / f:.2f}")


if __name__ == "__main__":
    main()
