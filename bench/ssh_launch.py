"""Launch -> all running, for N workers on 3 SSH hosts: cmlcluster against the same agents started by hand.

The hosts are the tests' (tests/harness/sshhosts.py: containers with their own IPs, key-only sshd, a
non-root user). Both sides use one warm session's controller, so only the launch is timed:

- ours: session.launch_workers(N) + await_workers until every worker runs (placement, one ssh
  per worker, the remote supervisor, the agent, registration, the worker's address learnt);
- by hand (the floor): N `ssh host python -m cmlcluster.agent` started in parallel, round robin
  over the hosts, until the controller has seen all N engines register.

Ratio = ours / by hand, medians of --repeat runs alternating. Goal <= 1.10 at 16 workers.
Both sides' median timelines are printed (bench/timeline.py).

    python bench/ssh_launch.py [--sizes 1 4 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.sshhosts import TestHosts, start_hosts
from timeline import Timeline, median_timeline  # bench/, the script's folder

from cmlcluster import Session
from cmlcluster.backends.ssh.backend import SSHBackend


def backend(hosts: TestHosts) -> SSHBackend:
    return SSHBackend(
        [f"{h.ip}:16" for h in hosts.hosts],
        user=hosts.user,
        identity=hosts.identity_file,
        known_hosts=hosts.known_hosts,
        python=hosts.python,
    )


def ours(session: Session, n: int) -> tuple[float, Timeline]:
    timeline = Timeline().follow(session)
    t0 = time.perf_counter()
    workers = session.launch_workers(n, cpu=1, memory=1)
    timeline.mark("launch_workers returned")
    result = session.await_workers(workers, wait_for_completion=False, timeout_seconds=300)
    elapsed = time.perf_counter() - t0
    timeline.mark("await_workers returned")
    assert len(result["workers"]) == n, result["failures"]
    session.stop_workers(*workers)
    timeline.stop_following()
    return elapsed, timeline


def by_hand(session: Session, hosts: TestHosts, n: int, first_id: int) -> tuple[float, Timeline]:
    control = session._supervisor.control
    assert control is not None
    env = control.agent_env() | {"CDSW_MASTER_IP": session.controller_ip, "PYTHONUNBUFFERED": "1"}
    client = session.client
    timeline = Timeline()
    t0 = time.perf_counter()
    processes = []
    for i in range(n):
        host = hosts.hosts[i % len(hosts.hosts)]
        variables = " ".join(
            f"{k}={shlex.quote(v)}" for k, v in (env | {"CMLCLUSTER_ENGINE_ID": str(first_id + i)}).items()
        )
        command = f"env {variables} {hosts.python} -m cmlcluster.agent"
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={hosts.known_hosts}"]
        argv += ["-i", hosts.identity_file, "-o", "IdentitiesOnly=yes", "-l", hosts.user, host.ip, command]
        processes.append(
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    timeline.mark("ssh processes started")
    wanted = set(range(first_id, first_id + n))
    while not wanted <= set(client.ids):
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    timeline.mark("every engine registered")
    client.shutdown(targets=sorted(wanted), block=True)
    for process in processes:
        process.wait(timeout=60)
    return elapsed, timeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with start_hosts(3) as hosts, Session(backend(hosts), echo=False) as session:
        ours(session, 1)  # warm: the controller and the hosts' caches
        print(json.dumps({"hosts": [h.ip for h in hosts.hosts]}))
        print(f"{'N':>3} {'cmlcluster s':>13} {'by hand s':>10} {'ratio':>6}  (medians of {args.repeat})")
        next_id = 10_000  # engine ids far from the session's own
        timelines = {}
        for n in args.sizes:
            mine, floor = [], []
            for _ in range(args.repeat):
                mine.append(ours(session, n))
                floor.append(by_hand(session, hosts, n, next_id))
                next_id += n
            m, f = statistics.median(s for s, _ in mine), statistics.median(s for s, _ in floor)
            spread = max(s for s, _ in floor) / min(s for s, _ in floor)
            print(f"{n:>3} {m:>13.2f} {f:>10.2f} {m / f:>6.2f}  (by-hand spread {spread:.2f})", flush=True)
            timelines[n] = (median_timeline(t for _, t in mine), median_timeline(t for _, t in floor))
        for n, (mine_timeline, floor_timeline) in timelines.items():
            print(f"median timelines, {n} workers, seconds from the call:")
            print(mine_timeline.format("ours (launch_workers + await_workers)"))
            print(floor_timeline.format("by hand"))


if __name__ == "__main__":
    main()
