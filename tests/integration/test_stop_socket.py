"""A live session's stop endpoint (cmlcluster/stop_socket.py), as the JupyterLab panel's server extension
uses it from another process: real local workers, stopped through the session itself, and nothing but a
stop request from the session's own user let through."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from harness.processes import wait_until

from cmlcluster import records, stop_socket
from cmlcluster.errors import ConfigError
from cmlcluster.session import Session

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SLEEPER = "import time; print('up', flush=True); time.sleep(600)"
STRANGER = 65534  # nobody
# What another user's process tries: connect and ask to stop everything; prints what happened.
ATTEMPT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect": type(e).__name__}))
    sys.exit()
try:
    s.sendall(b'{"stop": "all"}\\n')
except BrokenPipeError:
    pass  # refused before its request was read: the reply waits in the socket all the same
print(json.dumps({"reply": s.recv(4096).decode()}))
"""


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))


def running_session(n: int = 2) -> tuple[Session, list[dict]]:
    session = Session("local", echo=False)
    workers = session.launch_workers(n, cpu=0.5, memory=0.5, code=SLEEPER)
    session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
    session.drain(5)  # the record names the workers' pids
    return session, workers


def record_of(session: Session) -> dict:
    return next(r for r in records.records() if r["id"] == session.id)


def statuses(session: Session) -> dict[str, str]:
    return {w["id"]: w["status"] for w in session.list_workers()}


def process_ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ask(path: str, data: bytes) -> dict:
    """One raw request, as any process of the user's could send it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return json.loads(s.makefile().readline())


def test_a_stop_through_the_endpoint_ends_that_worker_through_the_session_and_all_ends_the_rest(state):
    session, workers = running_session(3)
    with session:
        record = record_of(session)
        path = record["control"]
        assert os.path.dirname(path) == session.session_dir
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
        pids = {w["id"]: session.worker_pid(w) for w in workers}
        first, *rest = [w["id"] for w in workers]

        assert stop_socket.request(path, [first]) == [first]
        wait_until(lambda: process_ended(pids[first]), 30, "the worker's process to end")
        wait_until(lambda: statuses(session)[first] == "stopped", 10, "the session to say stopped")
        assert [statuses(session)[i] for i in rest] == ["running", "running"]  # the others run on
        assert all(not process_ended(pids[i]) for i in rest)
        # The record, which the panel reads, says so too.
        wait_until(lambda: {w["id"]: w["status"] for w in record_of(session)["workers"]}[first] == "stopped", 10)

        assert stop_socket.request(path, [first]) == []  # ended already: nothing to stop, no error
        assert sorted(stop_socket.request(path, None)) == sorted(rest)
        wait_until(lambda: all(process_ended(pids[i]) for i in rest), 30, "every worker's process to end")
        wait_until(lambda: set(statuses(session).values()) == {"stopped"}, 10, "all stopped")
    assert not os.path.exists(path)  # the socket goes with the session


def test_an_unknown_worker_or_anything_but_a_stop_request_is_refused_and_stops_nothing(state):
    session, workers = running_session(1)
    with session:
        path = record_of(session)["control"]
        with pytest.raises(ConfigError, match=r"no worker 'nope' in session"):
            stop_socket.request(path, [workers[0]["id"], "nope"])
        refused = [
            b'{"run": "import os; os.system(\'touch /tmp/x\')"}\n',
            b'{"stop": "all", "code": "print(1)"}\n',
            b'{"stop": [1, 2]}\n',
            b'{"stop": "everything"}\n',
            b"[]\n",
            b"not json\n",
            b"x" * (stop_socket.MAX_REQUEST + 10),
        ]
        for data in refused:
            assert "error" in ask(path, data), data[:60]
        time.sleep(0.5)
        assert statuses(session) == {workers[0]["id"]: "running"}
        assert stop_socket.request(path, None) == [workers[0]["id"]]  # and it still serves


def as_stranger(path: str) -> dict:
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    done = subprocess.run(
        ["setpriv", f"--reuid={STRANGER}", f"--regid={STRANGER}", "--clear-groups", python, "-I", "-c", ATTEMPT, path],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_another_user_can_neither_reach_the_socket_nor_stop_anything_when_it_can(state, monkeypatch):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to become another uid")
    # The session's folder in a folder others may pass through (as /tmp is), so that only the session's
    # own folder's mode, then the peer check, stand in the stranger's way.
    base = tempfile.mkdtemp(prefix="lab-endpoint-", dir="/tmp")
    os.chmod(base, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", base)
    try:
        session, workers = running_session(1)
        with session:
            path = record_of(session)["control"]
            assert as_stranger(path) == {"connect": "PermissionError"}  # the session's folder is 0700
            # Were the folder and the socket open to everyone, the peer's uid still decides.
            os.chmod(session.session_dir, 0o711)
            os.chmod(path, 0o666)
            reply = json.loads(as_stranger(path)["reply"])
            assert reply == {"error": f"refused: uid {STRANGER} is not the session's user"}
            time.sleep(0.5)
            assert statuses(session) == {workers[0]["id"]: "running"}
            os.chmod(session.session_dir, 0o700)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_client_refuses_a_socket_that_another_user_serves(tmp_path):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to become another uid")
    base = tempfile.mkdtemp(prefix="lab-endpoint-", dir="/tmp")
    os.chmod(base, 0o777)
    path = os.path.join(base, "control.sock")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    serve = (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); print('up', flush=True)\n"
        "c, _ = s.accept(); c.recv(100); c.sendall(b'{\"stopping\": []}\\n'); time.sleep(5)\n"
    )
    server = subprocess.Popen(
        ["setpriv", f"--reuid={STRANGER}", f"--regid={STRANGER}", "--clear-groups", python, "-I", "-c", serve, path],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        with pytest.raises(OSError, match=f"served by uid {STRANGER}, not by you"):
            stop_socket.request(path, None)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(base, ignore_errors=True)
