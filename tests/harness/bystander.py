"""A user's cmlcluster session that runs beside the test suite, outside it.

`start()` runs this file as a process that is not the test run's child (a double fork before the run
becomes a subreaper), with the environment a user's notebook would have: no run tag, the default
state and temp folders replaced by folders of its own (so that nothing of the run lands there).
It starts two local workers and one Docker worker, writes ready.json, then answers `check` requests
(statuses, and each worker's pid as the worker itself says it) until told to stop, or until the test
process that started it has gone (so a killed run leaves no bystander behind).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cmlcluster.backends.base import RUN_TAG_ENV


@dataclass
class Bystander:
    folder: Path
    ready: dict

    def check(self, timeout: float = 60.0) -> dict:
        """What the bystander sees of its own workers now (statuses, pids from inside each)."""
        answer = self.folder / "checked.json"
        answer.unlink(missing_ok=True)
        (self.folder / "check").touch()
        return _read_when_there(answer, timeout)

    def stop(self, timeout: float = 60.0) -> dict:
        (self.folder / "stop").touch()
        return _read_when_there(self.folder / "stopped.json", timeout)

    def stopped(self) -> bool:
        return (self.folder / "stopped.json").exists()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def save(self, path: str) -> None:
        """For the run's other processes (pytest-xdist's workers): the test may run in any of them."""
        _write(Path(path), {"folder": str(self.folder), "ready": self.ready})

    @classmethod
    def saved(cls, path: str) -> Bystander:
        data = json.loads(Path(path).read_text())
        return cls(Path(data["folder"]), data["ready"])


def _read_when_there(path: Path, timeout: float, pid: int = 0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"the bystander wrote no {path.name} in {timeout:.0f} s")
        if pid and not os.path.exists(f"/proc/{pid}"):
            raise AssertionError(f"the bystander (pid {pid}) exited before it wrote {path.name}")
        time.sleep(0.1)
    return json.loads(path.read_text())


def start(image: str, timeout: float = 120.0) -> Bystander:
    """Start the bystander and return once its workers run."""
    folder = Path(tempfile.mkdtemp(prefix="cmlcluster-bystander-", dir="/tmp"))
    run_only = (RUN_TAG_ENV, "CMLCLUSTER_STATE_DIR", "CMLCLUSTER_TESTS_ROOT", "PYTEST_XDIST_WORKER")
    env = {k: v for k, v in os.environ.items() if k not in run_only}
    env |= {"CMLCLUSTER_STATE_DIR": str(folder / "state"), "TMPDIR": str(folder / "tmp")}
    (folder / "tmp").mkdir()
    log = open(folder / "bystander.log", "wb")
    # The first process forks the bystander, says its pid and exits: the orphan belongs to whoever
    # adopts orphans here, never to the test run.
    double_fork = (
        "import os, sys\n"
        "pid = os.fork()\n"
        "if pid: print(pid, flush=True); os._exit(0)\n"  # _exit flushes nothing: PYTHONUNBUFFERED may be unset
        "os.dup2(2, 1)\n"  # the log: the pipe that carried the pid must close
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    argv = [sys.executable, "-c", double_fork, __file__, str(folder), image, str(os.getpid())]
    launcher = subprocess.run(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True, check=True
    )
    log.close()
    pid = int(launcher.stdout)
    bystander = Bystander(folder, ready={})
    try:
        bystander.ready = _read_when_there(folder / "ready.json", timeout, pid)
    except AssertionError as e:
        (folder / "stop").touch()
        output = (folder / "bystander.log").read_text()[-3000:]
        with contextlib.suppress(AssertionError):
            _read_when_there(folder / "stopped.json", 60, pid)
        bystander.remove()
        raise AssertionError(f"the bystander did not start: {output}") from e
    return bystander


def main(folder: Path, image: str, test_pid: int) -> None:
    from cmlcluster import Session
    from cmlcluster.backends.docker.backend import DockerBackend

    local = Session("local", echo=False)
    docker = Session(DockerBackend(image=image, host_python=True), echo=False)
    sessions = (local, docker)
    try:
        local.await_workers(local.launch_workers(2, cpu=0.5, memory=0.5), False, 120)
        docker.await_workers(docker.launch_workers(1, cpu=0.5, memory=0.5), False, 120)

        def seen() -> dict:
            workers = [w for s in sessions for w in s.list_workers()]
            pids = [p for s in sessions for p in s.call_each([(w, "os:getpid", ()) for w in s.list_workers()], 30)]
            host_pids = [local.worker_pid(w) for w in local.list_workers()]
            return {
                "pid": os.getpid(),
                "statuses": [w["status"] for w in workers],
                "worker_pids": pids,
                "host_pids": host_pids,  # the local workers', as this host sees them
                "session_ids": [s.id for s in sessions],
            }

        _write(folder / "ready.json", seen())
        while not (folder / "stop").exists():
            if (folder / "check").exists():
                (folder / "check").unlink()
                _write(folder / "checked.json", seen())
            try:
                os.kill(test_pid, 0)
            except ProcessLookupError:
                break  # the run that started it has gone: a bystander must not outlive it
            time.sleep(0.2)
    finally:
        for s in sessions:
            s.close()
        _write(folder / "stopped.json", {"closed": [s.closed for s in sessions]})


def _write(path: Path, data: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").rename(path)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
