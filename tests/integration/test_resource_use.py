"""What real workers use, as their agents sample it (cmlcluster/usage.py): in list_workers() and as events
within seconds, never in their output or kept logs; a Docker container's memory limit; and
`cmlcluster list --watch` as a real process, ended by Ctrl-C."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, on
from harness.processes import wait_until

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.events import ResourceUse

pytestmark = pytest.mark.integration

MIB = 1 << 20
FAST = {"CMLCLUSTER_USAGE_SECONDS": "0.5"}  # a sample every half second, for the test's sake
# Holds 150 MiB (written, so resident) and keeps a core busy until stopped; prints one line first.
BUSY = "x = bytearray(b'x' * (150 << 20))\nprint('holding', len(x), flush=True)\nwhile True:\n    pass\n"


def cgroups_writable() -> bool:
    return os.access("/sys/fs/cgroup/memory", os.W_OK) or os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def test_local_workers_usage_shows_in_list_workers_and_events_and_nowhere_in_their_output():
    with Session("local", echo=False) as s:
        seen: list[ResourceUse] = []
        s.subscribe(lambda e: seen.append(e) if isinstance(e, ResourceUse) else None)
        busy, other = s.launch_workers(2, cpu=1, memory=0.5, code=BUSY, env=FAST)
        s.await_workers([busy, other], wait_for_completion=False, timeout_seconds=60)

        def sampled():
            listed = {w["id"]: w for w in s.list_workers()}
            w = listed[busy["id"]]
            return w if w.get("memory_bytes", 0) >= 150 * MIB and w["cpu_percent"] > 10 else None

        w = wait_until(sampled, what="the busy worker's CPU and 150 MiB in list_workers()")
        assert w["gpus"] == [] and isinstance(w["sampled_at"], float)
        # CML's fields are all there, as they were: what was asked among them.
        assert (w["cpu"], w["memory"], w["nvidia_gpu"], w["status"]) == (1.0, 0.5, 0, "running")
        if cgroups_writable():  # the local backend's cgroup enforces what was asked: that is the limit
            assert w["memory_limit_bytes"] == int(0.5 * 1024**3)
        wait_until(lambda: {e.worker_id for e in seen} == {busy["id"], other["id"]}, what="events of both workers")
        s.stop_workers()
        assert not any("cpu_percent" in w for w in s.list_workers())
        # Samples travel beside the output, never in it: not in output(), not in the kept log.
        for worker in (busy, other):
            output = s.output(worker)
            with open(s.worker_log_path(worker)) as f:
                log = f.read()
            for text in (output, log):
                assert not re.search(r"cpu_percent|memory_bytes|cmlcluster_usage|cmlcluster\.usage", text), text
        assert s.output(busy) == f"holding {150 * MIB}"
        assert s.output(other) == f"holding {150 * MIB}"


@pytest.mark.parametrize("backend", on("local", "docker", "ssh"), indirect=True)  # pods: -m matrix
def test_every_backends_workers_send_samples(session):
    # Wherever the agent runs (the session's Python, a container's, a host's, a pod's), psutil is there.
    [w] = session.launch_workers(1, cpu=0.5, memory=0.5, env=FAST)
    session.await_workers([w], wait_for_completion=False, timeout_seconds=60)
    sampled = wait_until(lambda: session.list_workers()[0].get("memory_bytes"), what="a sample of the worker")
    assert sampled > 10 * MIB  # its agent's Python at least
    assert "not sampled" not in session.worker_log(w)


def test_sampling_turned_off_sends_nothing():
    with Session("local", echo=False) as s:
        seen: list[ResourceUse] = []
        s.subscribe(lambda e: seen.append(e) if isinstance(e, ResourceUse) else None)
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5, env={"CMLCLUSTER_USAGE_SECONDS": "0"})
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        time.sleep(3)  # a sampler at its default period would have sent one by now
        s.drain()
        assert seen == []
        assert "cpu_percent" not in s.list_workers()[0]


def test_a_docker_containers_memory_limit_is_its_memory_limit_bytes(tmp_path_factory):
    shared = str(tmp_path_factory.getbasetemp())
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, volumes={shared: shared})
    with Session(backend, echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.75, env=FAST)
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        sampled = wait_until(
            lambda: next((x for x in s.list_workers() if "memory_limit_bytes" in x), None),
            what="a sample of the container's worker",
        )
        assert sampled["memory_limit_bytes"] == 768 * MIB
        assert 0 < sampled["memory_bytes"] < 768 * MIB


def watch_until(argv: list[str], row: re.Pattern[str]) -> tuple[list[str], int, str]:
    """Run `cmlcluster <argv>` until a line matches `row`; then Ctrl-C (SIGINT). Its lines, exit code, stderr."""
    watch = subprocess.Popen(
        [sys.executable, "-m", "cmlcluster", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any(row.search(line) for line in seen):
            assert time.monotonic() < deadline, "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
    finally:
        watch.send_signal(signal.SIGINT)
        code = watch.wait(30)
        reader.join(10)
    return seen, code, watch.stderr.read()


def test_cli_list_watch_refreshes_with_what_workers_use_and_ends_cleanly_on_ctrl_c():
    # The session is this test's: its record is in the run's state folder (CMLCLUSTER_STATE_DIR), which
    # the CLI process inherits.
    with Session("local", echo=False) as s:
        [w] = s.launch_workers(1, cpu=1, memory=0.5, code=BUSY, env=FAST)
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        # A row of the worker with a sample in it: CPU %, and its 150 MiB against its limit.
        row = re.compile(rf"^  w\d+\s+{w['id']}\s+running\s+1 · \d+ %\s+0\.\d+ / 0\.5 GiB")
        for argv in (["list", "--watch"], ["top"]):
            seen, code, errors = watch_until(argv, row)
            assert sum(line.startswith("cmlcluster: ") for line in seen) >= 1, seen
            assert f"session {s.id}  pid {os.getpid()}  local  up " in "".join(seen)
            assert code == 0 and errors == "", (argv, code, errors)  # Ctrl-C ends it: no traceback
