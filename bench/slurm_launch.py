"""Launch -> all running, for N workers as Slurm jobs: cmlcluster against the same agents started by hand.

The cluster is the tests' (tests/harness/slurm.py: Debian's Slurm 22.05, a controller and 4 nodes of 4
cores in containers, this machine the submit host). Both sides use one warm session's controller, so only
the launch is timed:

- ours: session.launch_workers(N) + await_workers until every worker runs (one worker: a job of its own, one
  srun; several: the launch's gang job, salloc --no-shell, then a step per worker; the task launcher, the
  agent, registration, the address learnt);
- by hand (the floor), the same shape: one worker, `srun --nodes=1 --ntasks=1 --cpus-per-task=1 --mem=200M
  python -m cmlcluster.agent`; several, `salloc --no-shell --ntasks=N ...` then N such steps (`srun
  --jobid=J`) started at once; until the controller has seen all N engines register.

Ratio = ours / by hand, medians of --repeat runs alternating. Goal <= 1.10 at 16 workers.

    python bench/slurm_launch.py [--sizes 1 4 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.slurm import SlurmCluster, start_slurm

from cmlcluster import Session
from cmlcluster.backends.slurm.backend import SlurmBackend


def ours(session: Session, n: int) -> float:
    t0 = time.perf_counter()
    workers = session.launch_workers(n, cpu=1, memory=0.2)
    result = session.await_workers(workers, wait_for_completion=False, timeout_seconds=300)
    elapsed = time.perf_counter() - t0
    assert len(result["workers"]) == n, result["failures"]
    session.stop_workers(*workers)
    return elapsed


def by_hand(session: Session, cluster: SlurmCluster, n: int, first_id: int) -> float:
    control = session._supervisor.control
    assert control is not None
    env = cluster.submit_env() | control.agent_env() | {"CDSW_MASTER_IP": session.controller_ip}
    client = session.client
    t0 = time.perf_counter()
    srun = ["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--mem=200M", "--chdir=/tmp", "--quiet"]
    job = ""
    if n > 1:
        salloc = ["salloc", "--no-shell", f"--ntasks={n}", "--cpus-per-task=1", "--mem-per-cpu=200M"]
        said = subprocess.run(salloc, env=env, capture_output=True, text=True, check=True).stderr
        job = said.rsplit("Granted job allocation ", 1)[1].split()[0]
        srun.insert(1, f"--jobid={job}")
    processes = []
    for i in range(n):
        agent_env = env | {"CMLCLUSTER_ENGINE_ID": str(first_id + i), "PYTHONUNBUFFERED": "1"}
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        processes.append(subprocess.Popen([*srun, sys.executable, "-m", "cmlcluster.agent"], env=agent_env, **quiet))
    wanted = set(range(first_id, first_id + n))
    while not wanted <= set(client.ids):
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    client.shutdown(targets=sorted(wanted), block=True)
    for process in processes:
        process.wait(timeout=60)
    if job:
        subprocess.run(["scancel", job], env=env, check=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with (
        start_slurm(nodes=4, cpus_per_node=4, memory_mb_per_node=4000) as cluster,
        Session(SlurmBackend(slurm_conf=cluster.conf), echo=False) as session,
    ):
        ours(session, 1)  # warm: the controller, the nodes' page cache
        print(json.dumps({"nodes": [n.ip for n in cluster.nodes], "cores": os.cpu_count()}))
        print(f"{'N':>3} {'cmlcluster s':>13} {'by hand s':>10} {'ratio':>6}  (medians of {args.repeat})")
        next_id = 10_000  # engine ids far from the session's own
        for n in args.sizes:
            mine, floor = [], []
            for _ in range(args.repeat):
                mine.append(ours(session, n))
                floor.append(by_hand(session, cluster, n, next_id))
                next_id += n
            m, f = statistics.median(mine), statistics.median(floor)
            print(f"{n:>3} {m:>13.2f} {f:>10.2f} {m / f:>6.2f}  (by-hand spread {max(floor) / min(floor):.2f})")


if __name__ == "__main__":
    main()
