"""What this test run started, and nothing else: its processes, its containers; and helpers to find and
kill the processes of a job (workers' agents, ranks) for tests of faults.

A test run owns exactly:

- the processes of its own tree: the pytest process is a child subreaper (conftest.py), so a process
  whose parent died (the workers of a killed kernel, a template's orphans) stays in the tree instead of
  moving to init, where the checks would lose it;
- the containers labelled with its run tag (RUN_TAG_LABEL=RUN_TAG), which cmlcluster's docker backend,
  the stand-in Kubernetes cluster's kubelet and the SSH test hosts put on every container they make,
  and the processes inside them.

Nothing here lists, reads or signals a process or container outside those, so a user's notebook session
running beside the suite is never touched (tests/integration/test_bystander.py checks it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psutil

from cmlcluster.backends.base import RUN_TAG_ENV, RUN_TAG_LABEL
from cmlcluster.pytorch.node import RANK as TORCH_RANK

# The run's tag; conftest.py sets it before any test runs, so every session of the run sees it.
RUN_TAG = os.environ.get(RUN_TAG_ENV, "")

# The command lines of what a session starts on this host: what a test must not leave running.
CMLCLUSTER_COMMANDS = (
    "cmlcluster.agent",
    "cmlcluster.control.controller",
    "cmlcluster.backends.ssh.remote",
    "cmlcluster.backends.docker.reaper",
    "ipyparallel.controller",
    "ipyparallel.engine",
    "cmlcluster.pytorch.launch",  # torchrun
    "cmlcluster/pytorch/rank.py",  # the processes it starts
    "cmlcluster.pytorch.store",  # an elastic run's rendezvous store, the session's
    "horovodrun",
    "cmlcluster.horovod.driver",  # horovodrun, as cmlcluster runs it
    "tensorboard",
)


def _live(processes) -> list[psutil.Process]:
    found = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def own_tree() -> list[psutil.Process]:
    """The live processes below this one (orphans included: this process is their subreaper)."""
    return _live(psutil.Process().children(recursive=True))


def run_containers(*, whole_run: bool = False, **filters) -> list:
    """This process's containers (running or not), or with whole_run those of every process of the run
    (their tags begin with this one: conftest.py); [] where no Docker engine answers."""
    if not RUN_TAG:
        return []
    try:
        import docker

        client = docker.from_env(timeout=10)
        tag = RUN_TAG_LABEL if whole_run else f"{RUN_TAG_LABEL}={RUN_TAG}"
        label = [tag, *filters.pop("label", [])]
        found = client.containers.list(all=True, filters={"label": label, **filters}, ignore_removed=True)
    except Exception:  # no Docker engine: nothing of the run there
        return []
    return [c for c in found if c.labels.get(RUN_TAG_LABEL, "").startswith(RUN_TAG)]


def run_networks(*, whole_run: bool = False) -> list:
    """This process's session networks on Docker (DockerBackend's own, one per session), or with
    whole_run those of every process of the run; [] where no Docker engine answers."""
    if not RUN_TAG:
        return []
    try:
        import docker

        client = docker.from_env(timeout=10)
        tag = RUN_TAG_LABEL if whole_run else f"{RUN_TAG_LABEL}={RUN_TAG}"
        found = client.networks.list(filters={"label": [tag, "cmlcluster.network=session"]})
    except Exception:  # no Docker engine: nothing of the run there
        return []
    return [n for n in found if (n.attrs.get("Labels") or {}).get(RUN_TAG_LABEL, "").startswith(RUN_TAG)]


def run_processes() -> list[psutil.Process]:
    """This run's live processes: its own tree, and the processes in its running containers."""
    found = own_tree()
    for container in run_containers(status="running"):
        with contextlib.suppress(psutil.Error, KeyError, ValueError):
            init = psutil.Process(int(container.attrs["State"]["Pid"]))
            found += _live([init, *init.children(recursive=True)])
    return found


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def running(text: str, processes: list[psutil.Process] | None = None) -> list[psutil.Process]:
    """The run's processes (or those given) whose command line contains `text`."""
    return [p for p in (run_processes() if processes is None else processes) if text in command_line(p)]


def cmlcluster_processes() -> list[psutil.Process]:
    """Workers, controllers, ranks, horovodrun and TensorBoard in this run's own tree."""
    return [p for p in own_tree() if any(c in command_line(p) for c in CMLCLUSTER_COMMANDS)]


def alive_after(pids: list[int], within: float) -> list[int]:
    """The pids still running (zombies count as gone) once `within` seconds have passed or all are gone."""
    deadline = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p.pid for p in _live(_processes(pids))]
    return alive


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


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


def agents(session_id: str | None = None) -> list[psutil.Process]:
    """The run's worker agents (of one session, when given), containers' included."""
    found = []
    for p in run_processes():
        if is_worker_agent(p) and (session_id is None or _started_for(p, session_id)):
            found.append(p)
    return found


def _started_for(process: psutil.Process, session_id: str) -> bool:
    """Whether an agent belongs to the session: by the environment it started with, or, forked from a
    template (whose environment it shows), by its log in the session's folder."""
    try:
        if process.environ().get("CDSW_MASTER_ID") == session_id:
            return True
        return any(f"{os.sep}cmlcluster-{session_id}-" in f.path for f in process.open_files())
    except psutil.Error:
        return False


def agent_pid(worker_id: str) -> int | None:
    """The pid (as this host sees it, containers included) of a worker's agent.

    Found by the environment it started with, or, for a local worker forked from a template (whose
    start environment it shows), by its output: its stdout is the FIFO workers/<id>.output, removed once
    opened (or, without a FIFO, its log file workers/<id>.log).
    """
    names = tuple(f"{os.sep}workers{os.sep}{worker_id}{suffix}" for suffix in (".output", ".log"))
    for proc in running("cmlcluster.agent"):
        try:
            if proc.environ().get("CDSW_ENGINE_ID") == worker_id:
                return proc.pid
            if "--template" in proc.cmdline() and any(
                path.removesuffix(" (deleted)").endswith(names) for path in descriptors(proc.pid)
            ):
                return proc.pid
        except psutil.Error:
            continue
    return None


def descriptors(pid: int) -> list[str]:
    """What a process's file descriptors point at (psutil's open_files leaves FIFOs out)."""
    paths = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return paths


def processes_running(script: Path) -> list[psutil.Process]:
    """The run's Python processes running `script` (the ranks; not horovodrun, not the shells that start them).

    A rank is `python script` (horovodrun on this machine), `python -m cmlcluster.horovod.rank script`
    (through a worker's sshd) or `python -u .../cmlcluster/pytorch/rank.py script` (started by torchrun).
    """
    ways = [[str(script)], ["-m", "cmlcluster.horovod.rank", str(script)], [TORCH_RANK, str(script)]]
    found = []
    for p in run_processes():
        try:
            python, *args = p.cmdline() or [""]
        except psutil.Error:
            continue
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
