"""An SSH worker's folders on its host: its own (cmlcluster-<id>-…) and its short TMPDIR (/tmp/cml-…),
made by its relay (ssh/remote.py) and removed at the worker's end, also when the worker or the relay
itself is killed with SIGKILL (then the relay's janitor removes them: ssh/janitor.py)."""

from __future__ import annotations

import time

import pytest
from harness.fixtures import ssh_backend
from harness.leaks import leftovers_on

from cmlcluster import Session

pytestmark = pytest.mark.integration

# Makes a Unix socket where Ray makes its longest (70 bytes under TMPDIR), prints TMPDIR, waits to be killed.
WORKER = """
import os, socket, time
tmp = os.environ["TMPDIR"]
sockets = os.path.join(tmp, "ray", "session_2026-11-28_10-04-30_123456_12345", "sockets")
os.makedirs(sockets)
socket.socket(socket.AF_UNIX).bind(os.path.join(sockets, "plasma_store"))
print("tmpdir", tmp, flush=True)
time.sleep(600)
"""


def _processes(host):
    """[(pid, ppid, args)] of alice's processes on `host`."""
    listed = host.exec("ps", "-u", "alice", "-o", "pid=,ppid=,args=").stdout.splitlines()
    return [(int(pid), int(ppid), args) for pid, ppid, args in (line.split(None, 2) for line in listed)]


def _folders(host):
    return host.exec("sh", "-c", "ls -d /tmp/cml-* /tmp/cmlcluster-* 2>/dev/null").stdout.split()


@pytest.mark.parametrize("killed", ["worker", "relay"])
def test_a_sigkilled_worker_or_relay_leaves_no_folder_nor_process_on_its_host(ssh_hosts, killed):
    with Session(ssh_backend(ssh_hosts), echo=False) as session:
        workers = session.launch_workers(1, cpu=0.2, memory=0.5, code=WORKER)
        ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
        assert ready["failures"] == [], ready["failures"]
        worker = ready["workers"][0]
        (host,) = [h for h in ssh_hosts.hosts if h.ip == worker["ip_address"]]
        deadline = time.monotonic() + 30
        while "tmpdir " not in session.output(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        tmpdir = session.output(worker).split("tmpdir ", 1)[1].split()[0]
        assert tmpdir.startswith("/tmp/cml-") and len(tmpdir) == len("/tmp/cml-12345678"), tmpdir
        assert tmpdir in _folders(host)
        assert any(f.startswith(f"/tmp/cmlcluster-{worker['id']}-") for f in _folders(host)), _folders(host)
        ((agent, relay),) = [(pid, ppid) for pid, ppid, args in _processes(host) if "cmlcluster.agent" in args]
        assert any(pid == relay and "backends.ssh.remote" in args for pid, _, args in _processes(host)), _processes(
            host
        )

        assert host.exec("kill", "-KILL", str(agent if killed == "worker" else relay)).returncode == 0

        # A dead relay looks to the session like a dropped connection: it connects again (an sshd and
        # `ssh_remote --attach` on the host), hears the worker is gone, and fails it. Only then is the host
        # sure to stay empty: a look before could fall between two of those tries.
        deadline = time.monotonic() + 30
        while session.list_workers()[0]["status"] == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session.list_workers()[0]["status"] == "failed", session.list_workers()
        deadline = time.monotonic() + 20
        while (_folders(host) or _processes(host)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = (_folders(host), _processes(host))
        assert left == ([], []), (left, session.output(worker)[-2000:])
    assert leftovers_on(ssh_hosts) == {}


# Starts a child that leaves the worker's process group and session, then waits to be killed.
ESCAPING_WORKER = """
import subprocess, time
escaped = subprocess.Popen(["setsid", "sleep", "600"])
print("escaped", escaped.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_relays_janitor_ends_what_left_the_workers_process_group(ssh_hosts):
    with Session(ssh_backend(ssh_hosts), echo=False) as session:
        workers = session.launch_workers(1, cpu=0.2, memory=0.5, code=ESCAPING_WORKER)
        ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
        assert ready["failures"] == [], ready["failures"]
        worker = ready["workers"][0]
        (host,) = [h for h in ssh_hosts.hosts if h.ip == worker["ip_address"]]
        deadline = time.monotonic() + 30
        while "escaped " not in session.output(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        escaped = int(session.output(worker).split("escaped ", 1)[1].split()[0])
        session_of = host.exec("ps", "-o", "sid=,args=", "-p", str(escaped)).stdout.split(None, 1)
        # A session of its own: out of the worker's process group, which the janitor signals.
        assert session_of[1].strip() == "sleep 600" and int(session_of[0]) == escaped, session_of
        (relay,) = [ppid for _, ppid, args in _processes(host) if "cmlcluster.agent" in args]

        assert host.exec("kill", "-KILL", str(relay)).returncode == 0

        deadline = time.monotonic() + 20
        while (_folders(host) or _processes(host)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _folders(host) == [] and _processes(host) == [], (_folders(host), _processes(host))
    assert leftovers_on(ssh_hosts) == {}
