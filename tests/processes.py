"""Finding and killing the processes of a job, for tests of faults: workers' agents, ranks."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil

from cmlcluster.pytorch.node import RANK as TORCH_RANK


def wait_until(condition, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def is_worker_agent(process: psutil.Process) -> bool:
    """A worker's agent, not a local template (which forks agents, and whose command line they show:
    an agent forked by a template is the template's child)."""
    try:
        cmdline = process.cmdline()
        if "cmlcluster.agent" not in cmdline:
            return False
        return cmdline[-1:] != ["--template"] or process.parent().cmdline()[-1:] == ["--template"]
    except (psutil.Error, AttributeError):  # ended, or an orphan whose parent went
        return False


def agent_pid(worker_id: str) -> int | None:
    """The pid (as this host sees it, containers included) of a worker's agent.

    Found by the environment it started with, or, for a local worker forked from a template (whose
    start environment it shows), by its log: the agent keeps a descriptor on workers/<id>.log.
    """
    log_name = f"{os.sep}workers{os.sep}{worker_id}.log"
    for proc in psutil.process_iter(["cmdline"]):
        if "cmlcluster.agent" in " ".join(proc.info["cmdline"] or []):
            try:
                if proc.environ().get("CDSW_ENGINE_ID") == worker_id:
                    return proc.pid
                if "--template" in proc.info["cmdline"] and any(f.path.endswith(log_name) for f in proc.open_files()):
                    return proc.pid
            except psutil.Error:
                continue
    return None


def processes_running(script: Path) -> list[psutil.Process]:
    """The Python processes running `script` (the ranks; not horovodrun, not the shells that start them).

    A rank is `python script` (horovodrun on this machine), `python -m cmlcluster.horovod.rank script`
    (through a worker's sshd) or `python -u .../cmlcluster/pytorch/rank.py script` (started by torchrun).
    """
    ways = [[str(script)], ["-m", "cmlcluster.horovod.rank", str(script)], [TORCH_RANK, str(script)]]
    found = []
    for p in psutil.process_iter(["cmdline"]):
        python, *args = p.info["cmdline"] or [""]
        args = args[1:] if args[:1] == ["-u"] else args  # torchrun runs `python -u ...`
        if os.path.basename(python).startswith("python") and any(args[: len(way)] == way for way in ways):
            found.append(p)
    return found


def kill_later(condition, victim, what):
    """On a thread: once condition() holds, kill -9 victim()'s pid; returns a dict that gets the time."""
    killed: dict[str, float] = {}

    def kill():
        wait_until(condition, what=what)
        time.sleep(0.5)
        os.kill(victim(), signal.SIGKILL)
        killed["at"] = time.monotonic()

    threading.Thread(target=kill, daemon=True).start()
    return killed


def time_all_gone(script: Path, timeout: float = 300.0) -> dict[str, float]:
    """On a thread: once processes running script have appeared and are all gone, the wall-clock
    time (time.time(), comparable with times the processes print) goes into the returned dict."""
    gone: dict[str, float] = {}

    def watch():
        wait_until(lambda: processes_running(script), timeout, f"processes running {script}")
        while processes_running(script):
            time.sleep(0.05)
        gone["at"] = time.time()

    threading.Thread(target=watch, daemon=True).start()
    return gone
