"""An elastic Horovod run (run_horovod's max_restarts) that loses a worker: the time from the kill to
training again, beside a fresh start of the same job, in one run.

Each repeat, on Docker workers, in a session whose controller already runs: run_horovod of the
example (hvd.elastic.run) on two workers with max_restarts=1; the fresh start is run_horovod's call
to rank 0's first reported step (two containers, their sshd and pinned host keys, horovodrun, the
ranks' start). Once rank 0 has trained an epoch, worker 1's container is killed (`docker kill`);
then two figures: kill -> the survivor training again (Horovod's reset to one rank), and kill -> the
new rank training too (the lost worker dropped, a container launched in its place with sshd and its
key, horovodrun's host discovery listing it, the reset to two ranks, the state synchronised). The run is
stopped there.

    python bench/horovod_recovery.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from repeats import medians  # bench/, the script's folder

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.events import JobChanged, Progress
from cmlcluster.horovod import run_horovod

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "worker_scripts" / "horovod_keras_train.py")
IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
STEPS = 20  # per epoch
# Long: a rank alone trains about 400 steps a second here, and must not finish before the new one joins. The
# run is stopped once both train again (it is the recovery that is timed, not the rest of the run).
ARGS = ["--epochs", "2000", "--steps-per-epoch", str(STEPS)]


def once() -> dict[str, float]:
    """Seconds: "fresh" (call -> first step), "survivor" and "both" (kill -> training again)."""
    with Session(DockerBackend(image=IMAGE, host_python=True), echo=False) as session:
        warm = session.launch_workers(1, 0.5, 0.5)  # the controller up first: the start measured is the run's
        session.await_workers(warm, wait_for_completion=False, timeout_seconds=60)
        session.stop_workers(*warm)
        times: dict[str, float] = {}
        alone = [""]  # the task that trained on alone, as last reported
        seen: list[tuple[float, str, float]] = []  # every step reported: (when, task, step), for a failure's message
        lock = threading.Lock()

        def kill_worker() -> None:
            import docker

            victim = session.list_workers()[2]["id"]  # the run's second worker, after the warm-up one
            docker.from_env().containers.get(f"cmlcluster-{victim}").kill("SIGKILL")
            times["killed"] = time.monotonic()

        def on_event(event: object) -> None:
            with lock:
                now = time.monotonic()
                if isinstance(event, JobChanged) and event.state == "member_replaced":
                    times["replaced"] = now
                if not isinstance(event, Progress):
                    return
                times.setdefault("first", now)
                seen.append((now, event.task, event.step))
                if event.task == "rank 0" and event.step >= STEPS and "killing" not in times:
                    times["killing"] = now
                    threading.Thread(target=kill_worker, daemon=True).start()
                # A step reported just before the kill may be told just after it.
                if "killed" not in times or now < times["killed"] + 0.5:
                    return
                times.setdefault("survivor", now)
                if "replaced" not in times:
                    alone[0] = event.task  # the survivor's label once Horovod reset it to one rank
                elif event.task != alone[0] and "both" not in times:  # the new rank (the reset to two leaves
                    times["both"] = now  # the survivor's label as it was)
                    threading.Thread(target=session.stop_workers, daemon=True).start()

        session.subscribe(on_event)
        started = time.monotonic()
        result = run_horovod(SCRIPT, ARGS, np=2, cpu=1, memory=1, max_restarts=1, session=session)
        if result.restarts != 1:
            sys.exit(f"the run did not recover: {result.message}")
        if "both" not in times:
            after = [(round(t - times["killed"], 1), task, step) for t, task, step in seen if t > times["killed"]]
            replaced = round(times.get("replaced", float("nan")) - times["killed"], 1)
            sys.exit(f"no new rank was seen training; replaced at {replaced} s; steps after the kill: {after}")
        return {
            "fresh": times["first"] - started,
            "survivor": times["survivor"] - times["killed"],
            "both": times["both"] - times["killed"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    median = medians(
        once,
        args.repeat,
        lambda run: (
            f"fresh start to the first step: {run['fresh']:5.1f} s   kill to the survivor training: "
            f"{run['survivor']:5.1f} s   kill to both ranks training: {run['both']:5.1f} s"
        ),
    )
    print(
        f"docker, worker 1 killed, medians of {args.repeat}: fresh start {median['fresh']:.1f} s, survivor training "
        f"again {median['survivor']:.1f} s, both ranks {median['both']:.1f} s (ratio to a fresh start "
        f"{median['both'] / median['fresh']:.2f})"
    )


if __name__ == "__main__":
    main()
