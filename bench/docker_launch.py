"""Docker workers: launch -> all running for 1, 4 and 16 containers, against a floor built by hand;
and the time to stop 16 against the time to stop 1.

The floor does the same work with nothing of cmlcluster: an ipyparallel controller on the
network's gateway (threaded, no database, as cmlcluster's is), then N containers started in
parallel with the docker SDK (same image, mounts and network), each running a plain ipyparallel
engine, until all N engines have registered. cmlcluster's figure is launch_workers +
await_workers(wait_for_completion=False), which also learns every worker's address.
Goal: ratio <= 1.25 at each N; stopping 16 < 2x stopping 1.

    python bench/docker_launch.py [--sizes 1 4 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import docker
import ipyparallel as ipp

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend

IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
NETWORK = "cmlcluster"
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def backend() -> DockerBackend:
    return DockerBackend(image=IMAGE, host_python=True, mount_cwd=False)


def ours(n: int) -> tuple[float, float]:
    """(launch -> all running, stop all) in seconds."""
    with Session(backend(), echo=False) as session:
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.5, memory=0.5)
        result = session.await_workers(workers, wait_for_completion=False, timeout_seconds=300)
        started = time.perf_counter() - t0
        assert len(result["workers"]) == n, result["failures"]
        t0 = time.perf_counter()
        session.stop_workers()
        return started, time.perf_counter() - t0


def floor(n: int, client: docker.DockerClient, gateway: str) -> float:
    with tempfile.TemporaryDirectory() as profile:
        t0 = time.perf_counter()
        controller = subprocess.Popen(
            [sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={profile}", f"--ip={gateway}",
             "--IPController.use_threads=True", "--nodb", "--log-level=40"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        engine_file = os.path.join(profile, "security", "ipcontroller-engine.json")
        client_file = os.path.join(profile, "security", "ipcontroller-client.json")
        while not (os.path.exists(engine_file) and os.path.exists(client_file)):
            assert controller.poll() is None, "the controller exited"
            time.sleep(0.02)
        rc = ipp.Client(client_file)
        mounts = [f"{p}:{p}:ro" for p in {"/usr", sys.base_prefix, sys.prefix, PACKAGE_PARENT, profile}]

        def run(i: int):
            return client.containers.run(
                IMAGE,
                [sys.executable, "-m", "ipyparallel.engine", f"--file={engine_file}", "--log-level=40"],
                detach=True, auto_remove=True, init=True, network=NETWORK, volumes=mounts,
                nano_cpus=500_000_000, mem_limit="512m", labels={"cmlcluster-bench": "floor"},
            )  # fmt: skip

        with ThreadPoolExecutor(32) as pool:
            containers = list(pool.map(run, range(n)))
        rc.wait_for_engines(n, timeout=300)
        elapsed = time.perf_counter() - t0
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda c: c.remove(force=True), containers))
        rc.close()
        controller.kill()
        controller.wait()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    client = docker.from_env(max_pool_size=64)
    # One network for the whole run (a session removes a network it created when it ends).
    try:
        network = client.networks.get(NETWORK)
    except docker.errors.NotFound:
        network = client.networks.create(NETWORK, driver="bridge")
    network.reload()
    gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
    print(f"{'N':>3} {'cmlcluster s':>13} {'by hand s':>10} {'ratio':>6} {'stop s':>7}  (medians of {args.repeat})")
    stops = {}
    for n in args.sizes:
        mine, theirs, stop = [], [], []
        for _ in range(args.repeat):
            started, stopped = ours(n)
            mine.append(started)
            stop.append(stopped)
            theirs.append(floor(n, client, gateway))
        m, t = statistics.median(mine), statistics.median(theirs)
        stops[n] = statistics.median(stop)
        print(f"{n:>3} {m:>13.2f} {t:>10.2f} {m / t:>6.2f} {stops[n]:>7.2f}", flush=True)
    if 1 in stops and 16 in stops:
        print(f"stopping 16 / stopping 1: {stops[16] / stops[1]:.2f} (goal < 2)")


if __name__ == "__main__":
    main()
