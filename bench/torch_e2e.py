"""%torchrun end to end against the same job done by hand, in one run.

By hand: two containers (same image, mounts, network and CPU/memory limits as the docker backend's
workers), their IPs read from Docker, then `torchrun --nnodes 2 --node-rank i --nproc-per-node 2
--master-addr <ip of the first> --master-port 29500 script` started with `docker exec` in each, at
once. Ours: run_torch (what %torchrun calls) on a fresh session: controller, two worker containers,
a free port picked on worker 0, the rendezvous checked, torchrun on each, teardown. Repeats are
interleaved (ours, by hand, ours, ...), and the spread of the by-hand runs is printed beside the
ratio, so that noise and a real gap can be told apart. Goal: ratio (ours / by hand) <= 1.05.
Both sides' median timelines are printed (bench/timeline.py).

    python bench/torch_e2e.py [--repeat 5] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
from timeline import Timeline, median_timeline  # bench/, the script's folder

from cmlcluster import Session, run_torch
from cmlcluster.backends.docker.backend import DockerBackend

IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "worker_scripts" / "torch_ddp_train.py")
CPU, MEMORY_GB, NPROC = 1, 2, 2  # per worker, on both sides


def ours(epochs: int) -> tuple[float, Timeline]:
    timeline = Timeline()
    t0 = time.perf_counter()
    with Session(DockerBackend(image=IMAGE, host_python=True), echo=False) as session:
        timeline.follow(session)
        result = run_torch(
            SCRIPT, ["--epochs", str(epochs)], nnodes=2, nproc_per_node=NPROC, cpu=CPU, memory=MEMORY_GB,
            session=session, echo=False,
        )  # fmt: skip
        timeline.mark("run_torch returned")
    elapsed = time.perf_counter() - t0
    timeline.mark("session closed")
    assert result.ok, result.message
    return elapsed, timeline


def by_hand(epochs: int, client: docker.DockerClient) -> tuple[float, Timeline]:
    timeline = Timeline()
    mounts = [f"{p}:{p}:ro" for p in {"/usr", sys.base_prefix, sys.prefix, str(ROOT)}]
    t0 = time.perf_counter()
    timeline.start = time.time()

    def run(_: int):
        return client.containers.run(
            IMAGE, [sys.executable, "-c", "import time; time.sleep(3600)"],
            detach=True, auto_remove=True, init=True, network="cmlcluster", volumes=mounts,
            nano_cpus=int(CPU * 1e9), mem_limit=f"{MEMORY_GB}g", working_dir=str(ROOT),
            environment={"OMP_NUM_THREADS": "1"}, labels={"cmlcluster-bench": "by-hand"},
        )  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        containers = list(pool.map(run, range(2)))
    timeline.mark("containers started")
    try:
        for c in containers:
            c.reload()
        master = containers[0].attrs["NetworkSettings"]["Networks"]["cmlcluster"]["IPAddress"]
        timeline.mark("addresses read")

        def torchrun(node_rank: int) -> int:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                    "--nproc-per-node", str(NPROC), "--master-addr", master, "--master-port", "29500",
                    SCRIPT, "--epochs", str(epochs)]  # fmt: skip
            return containers[node_rank].exec_run(argv).exit_code

        with ThreadPoolExecutor(2) as pool:
            codes = list(pool.map(torchrun, range(2)))
        assert codes == [0, 0], codes
        timeline.mark("torchrun returned")
    finally:
        for c in containers:
            c.remove(force=True)
    timeline.mark("containers removed")
    return time.perf_counter() - t0, timeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
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
    ours_s, hand_s = [s for s, _ in mine], [s for s, _ in theirs]
    m, t = statistics.median(ours_s), statistics.median(hand_s)
    print(f"ours:    {' '.join(f'{x:.2f}' for x in ours_s)}")
    print(f"by hand: {' '.join(f'{x:.2f}' for x in hand_s)} (spread {max(hand_s) / min(hand_s):.2f})")
    print(f"torchrun, 2 containers x {NPROC} processes, end to end: %torchrun {m:.2f} s, by hand {t:.2f} s, "
          f"ratio {m / t:.2f} (goal <= 1.05)")  # fmt: skip
    print("median timelines, seconds from the call:")
    print(median_timeline(t for _, t in mine).format("ours (run_torch on a new session)"))
    print(median_timeline(t for _, t in theirs).format("by hand"))


if __name__ == "__main__":
    main()
