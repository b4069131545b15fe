"""A Slurm job step's launcher, run here as srun runs it on a node: the worker in a private folder that goes
at its end, its exit code as srun reports it, a time limit's SIGUSR1 that ends nothing, and a stop that ends
all it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

TASK = [sys.executable, "-m", "cmlcluster.backends.slurm.task", "--"]


def test_the_worker_runs_in_a_private_folder_that_goes_with_it_and_its_code_comes_back():
    code = "import json, os, sys; print(json.dumps([os.getcwd(), os.environ['TMPDIR']])); sys.exit(3)"
    ran = subprocess.run([*TASK, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 3, ran.stderr
    work, tmp = json.loads(ran.stdout)
    assert os.path.dirname(work) == os.path.dirname(tmp) and os.path.basename(work) == "work"
    assert not os.path.exists(os.path.dirname(work))  # removed at the end


def test_a_stop_ends_the_worker_and_what_it_started_and_usr1_ends_nothing(tmp_path):
    pids, usr1 = tmp_path / "pids", tmp_path / "usr1"
    code = f"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGUSR1, lambda *a: open({str(usr1)!r}, "w").close())
child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
while True:
    time.sleep(0.1)
"""
    task = subprocess.Popen([*TASK, sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text().count(" ") == 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker, escaped = map(int, pids.read_text().split())  # the second left the worker's group and session
    for pid in (task.pid, worker):  # srun's --signal before a time limit reaches every process of the step
        os.kill(pid, signal.SIGUSR1)
    while not usr1.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert usr1.exists() and task.poll() is None  # the program's handler ran; the launcher goes on
    task.send_signal(signal.SIGTERM)  # srun passing on the session's stop
    assert task.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in (worker, escaped):
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
