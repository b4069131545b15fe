"""%horovod end to end against the same job done by hand, in one run.

By hand: two containers running sshd (same image, mounts, network and CPU/memory limits as the
docker backend's workers), their IPs read from Docker, a key and host keys made beforehand, then
`horovodrun -np 2 -H ip1:1,ip2:1 -p 2222 -i key` with the same training script. Ours:
run_horovod (what %horovod calls) on a fresh session: controller, two worker containers,
sshd through the agents, host keys pinned and checked, horovodrun, teardown.
Goal: ratio (ours / by hand) <= 1.05. Both sides' median timelines are printed (bench/timeline.py).

    python bench/horovod_e2e.py [--repeat 3] [--epochs 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
from timeline import Timeline, median_timeline  # bench/, the script's folder

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.horovod import run_horovod
from cmlcluster.ssh.keys import new_ed25519

IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "worker_scripts" / "horovod_keras_train.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
CPU, MEMORY_GB = 1, 1  # per worker, on both sides: the same job asks for the same resources


def ours(epochs: int) -> tuple[float, Timeline]:
    timeline = Timeline()
    t0 = time.perf_counter()
    with Session(DockerBackend(image=IMAGE, host_python=True), echo=False) as session:
        timeline.follow(session)
        result = run_horovod(
            # echo=True: the ranks' output and progress reach the session (whose own echo is off), for the timeline.
            SCRIPT,
            ["--epochs", str(epochs)],
            np=2,
            cpu=CPU,
            memory=MEMORY_GB,
            session=session,
            echo=True,
        )
        timeline.mark("run_horovod returned")
    elapsed = time.perf_counter() - t0
    timeline.mark("session closed")
    assert result.ok, result.message
    return elapsed, timeline


def by_hand(epochs: int, client: docker.DockerClient) -> tuple[float, Timeline]:
    timeline = Timeline()
    with tempfile.TemporaryDirectory() as folder:
        private, public = new_ed25519()
        host_private, _ = new_ed25519()
        files = {
            "id": private,
            "authorized_keys": public + "\n",
            "host_key": host_private,
            "sshd_config": f"Port 2222\nHostKey {folder}/host_key\nAuthorizedKeysFile {folder}/authorized_keys\n"
            "PasswordAuthentication no\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n",
        }
        for name, text in files.items():
            path = os.path.join(folder, name)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(text)
        mounts = [f"{p}:{p}:ro" for p in {"/usr", sys.base_prefix, sys.prefix, str(ROOT), folder}]
        t0 = time.perf_counter()

        def run(_: int):
            return client.containers.run(
                IMAGE,
                ["/bin/sh", "-c", f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -f {folder}/sshd_config"],
                detach=True, auto_remove=True, init=True, network="cmlcluster", volumes=mounts,
                nano_cpus=int(CPU * 1e9), mem_limit=f"{MEMORY_GB}g",  # what run_horovod's workers get
                working_dir=str(ROOT), labels={"cmlcluster-bench": "by-hand"},
            )  # fmt: skip

        timeline.start = time.time()
        with ThreadPoolExecutor(2) as pool:
            containers = list(pool.map(run, range(2)))
        timeline.mark("containers started")
        try:
            ips = []
            for c in containers:
                c.reload()
                ips.append(c.attrs["NetworkSettings"]["Networks"]["cmlcluster"]["IPAddress"])
            for ip in ips:
                while True:
                    try:
                        socket.create_connection((ip, 2222), timeout=1).close()
                        break
                    except OSError:
                        time.sleep(0.05)
            timeline.mark("sshd answering")
            argv = [HOROVODRUN, "-np", "2", "-H", ",".join(f"{ip}:1" for ip in ips), "-p", "2222",
                    "-i", f"{folder}/id", "--network-interfaces", "eth0",
                    sys.executable, SCRIPT, "--epochs", str(epochs)]  # fmt: skip
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            timeline.mark("horovodrun returned")
        finally:
            for c in containers:
                c.remove(force=True)
        timeline.mark("containers removed")
        return time.perf_counter() - t0, timeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    client = docker.from_env()
    try:
        client.networks.get("cmlcluster")
    except docker.errors.NotFound:
        client.networks.create("cmlcluster", driver="bridge")
    mine, theirs = [], []
    for _ in range(args.repeat):
        mine.append(ours(args.epochs))
        theirs.append(by_hand(args.epochs, client))
    m, t = statistics.median(s for s, _ in mine), statistics.median(s for s, _ in theirs)
    spread = max(s for s, _ in theirs) / min(s for s, _ in theirs)
    print(
        f"horovod, 2 containers, end to end: %horovod {m:.2f} s, by hand {t:.2f} s (spread {spread:.2f}), "
        f"ratio {m / t:.2f} (goal <= 1.05)"
    )
    print("median timelines, seconds from the call:")
    print(median_timeline(t for _, t in mine).format("ours (run_horovod on a new session)"))
    print(median_timeline(t for _, t in theirs).format("by hand"))


if __name__ == "__main__":
    main()
