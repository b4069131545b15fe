"""A worker's raw output over SSH: the SSH backend against plain ssh, on one of the tests' SSH hosts.

An SSH worker's output goes agent -> its relay (which keeps the last 8 MiB, so a dropped connection
loses nothing: backends/ssh_relay.py) -> the bridge in the ssh login -> ssh -> the session's frame reader
-> the worker's capped log. The floor is what it replaced: `ssh host <program>` with ssh's stdout and
stderr copied into the same kind of capped log (logfile.start_process, as the SSH backend did). Both run
the same program, which writes --megabytes of 100-byte lines and exits; each is timed from the start of
ssh to the end of the output. Ratio = ours / plain, medians of --repeat runs alternating. Goal: the relay
costs little (<= 1.5).

    python bench/ssh_output.py [--megabytes 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.sshhosts import TestHosts, start_hosts

from cmlcluster.backends.base import SessionContext
from cmlcluster.backends.ssh.backend import SSHBackend
from cmlcluster.logfile import start_process
from cmlcluster.workers import Resources, WorkerSpec

PROGRAM = "import os\nchunk = (b'x' * 99 + b'\\n') * 655\nfor _ in range({n}):\n    os.write(1, chunk)\n"


def program(megabytes: int) -> str:
    return PROGRAM.format(n=megabytes * 1_000_000 // 65_500)


def ours(hosts: TestHosts, megabytes: int, folder: str, run: int) -> float:
    backend = SSHBackend([hosts.hosts[0].ip], user=hosts.user, identity=hosts.identity_file,
                         known_hosts=hosts.known_hosts, python=hosts.python)  # fmt: skip
    spec = WorkerSpec(
        worker_id=f"bench-{run}",
        engine_id=run,
        argv=(hosts.python, "-c", program(megabytes)),
        env={},
        resources=Resources(cpu=1, memory=1),
        cwd=folder,
    )

    async def go() -> float:
        await backend.attach(SessionContext(session_id=f"bench{os.getpid()}", session_dir=folder))
        t0 = time.perf_counter()
        handle = await backend.start(spec)
        code = await backend.wait(handle)
        elapsed = time.perf_counter() - t0
        assert code == 0, backend.output(handle)[-2000:]
        await backend.close()
        return elapsed

    return asyncio.run(go())


def plain(hosts: TestHosts, megabytes: int, folder: str) -> float:
    argv = hosts.ssh_argv(hosts.hosts[0], hosts.python, "-c", shlex.quote(program(megabytes)), options=["-T"])

    async def go() -> float:
        t0 = time.perf_counter()
        process, output = await start_process(os.path.join(folder, "plain.log"), *argv, stdin=subprocess.DEVNULL)
        assert await process.wait() == 0
        await output.drain(60)
        return time.perf_counter() - t0

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with start_hosts(1) as hosts, tempfile.TemporaryDirectory() as folder:
        times: dict[str, list[float]] = {"ours": [], "plain": []}
        for run in range(args.repeat):
            times["plain"].append(plain(hosts, args.megabytes, folder))
            times["ours"].append(ours(hosts, args.megabytes, folder, run))
        medians = {k: statistics.median(v) for k, v in times.items()}
        for name, seconds in medians.items():
            print(f"{name:>5}: {seconds:.2f} s for {args.megabytes} MB ({args.megabytes / seconds:.0f} MB/s)")
        print(f"ratio ours / plain: {medians['ours'] / medians['plain']:.2f}")


if __name__ == "__main__":
    main()
