"""Secrets stay secret, SSH stays narrow, on real processes.

- env= values, and the notebook's own variables, are on no command line of any process on this
  machine while a Horovod job and a PyTorch job run on local workers (every process's argv is read,
  as `ps` would show it to any user), and the job's ranks see them.
- A worker's sshd (cmlcluster.ssh.sshd, as Horovod starts it) listens on the address given,
  admits its own user only, and refuses local, remote and stdio forwarding.
- A worker's sshd runs as a uid /etc/passwd does not name (Docker workers as the user's uid, pods
  under a random uid) and admits it.
- Host keys trusted on first use by the SSH backend land in cmlcluster's own known_hosts file,
  never in the user's.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pathspec
import psutil
import pytest
from harness.horovod_scripts import RANK

import cmlcluster
from cmlcluster import Session
from cmlcluster.agent import files as agent_files
from cmlcluster.backends.ssh.backend import SSHBackend
from cmlcluster.horovod import run_horovod
from cmlcluster.ports import free_ports
from cmlcluster.pytorch import run_torch
from cmlcluster.ssh import sshd
from cmlcluster.ssh.config import known_hosts_text
from cmlcluster.ssh.keys import SessionSSH

pytestmark = pytest.mark.integration

# A rank reports a digest of what it sees (not the value: its output is not the subject here), then
# stays a while so that the command lines are read while every rank runs.
SHOW_MARKER = """
import hashlib, os, sys, time
{init}
for name in ("CMLC_MARKER", "CMLC_NOTEBOOK_MARKER"):
    print("marker digest", hashlib.sha256(os.environ.get(name, "").encode()).hexdigest(), flush=True)
time.sleep(4)
"""
HOROVOD_INIT = RANK + "print('rank', rank, 'of', size, flush=True)"


class ArgvWatch:
    """Reads every process's command line on this machine until stopped; remembers where `marker` showed
    and whether a process whose command line holds `seen_if` (the job's script) was running then."""

    def __init__(self, marker: str, seen_if: str):
        self.marker, self.seen_if = marker, seen_if
        self.found: list[str] = []
        self.scans_with_job = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ArgvWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            job = False
            for p in psutil.process_iter(["cmdline"]):
                argv = " ".join(p.info["cmdline"] or [])
                if self.marker in argv:
                    self.found.append(f"{p.pid}: {argv}")
                job = job or self.seen_if in argv
            self.scans_with_job += job
            time.sleep(0.05)


def secrets_both_ways(monkeypatch) -> tuple[str, dict[str, str]]:
    """One value passed as env=, another the notebook holds in its environment (a CML API key, say):
    one marker that each holds half of, so that a command line holding either shows the marker."""
    marker = f"cmlc-marker-{secrets.token_hex(12)}"
    monkeypatch.setenv("CMLC_NOTEBOOK_MARKER", marker + "-notebook")
    return marker, {"CMLC_MARKER": marker + "-env"}


def check_no_argv_held(watch: ArgvWatch, result, marker: str, ranks: int) -> None:
    assert result.ok, result.message
    assert watch.found == [], "a value was on a command line"
    assert watch.scans_with_job >= 5, "the command lines were not read while the job ran"
    digests = [hashlib.sha256(f"{marker}-{how}".encode()).hexdigest() for how in ("env", "notebook")]
    seen = [line for lines in result.output.values() for line in lines if line.startswith("marker digest")]
    # every rank saw both values
    assert sorted(seen) == sorted(f"marker digest {d}" for d in digests * ranks)


def test_horovod_env_values_are_on_no_command_line_and_ranks_see_them(tmp_path, monkeypatch):
    marker, env = secrets_both_ways(monkeypatch)
    script = tmp_path / f"hvd_marker_{secrets.token_hex(4)}.py"
    script.write_text(SHOW_MARKER.format(init=HOROVOD_INIT))
    with Session("local", echo=False) as session, ArgvWatch(marker, script.name) as watch:
        result = run_horovod(str(script), np=2, env=env, session=session, echo=False)
        check_no_argv_held(watch, result, marker, ranks=2)
        assert not [p for p in os.listdir(session.session_dir) if p.startswith("rank-env-")]  # the file is gone


def test_torch_env_values_are_on_no_command_line_and_ranks_see_them(tmp_path, monkeypatch):
    marker, env = secrets_both_ways(monkeypatch)
    script = tmp_path / f"torch_marker_{secrets.token_hex(4)}.py"
    script.write_text(SHOW_MARKER.format(init="import torch"))
    with Session("local", echo=False) as session, ArgvWatch(marker, script.name) as watch:
        result = run_torch(str(script), nnodes=2, nproc_per_node=1, env=env, session=session, echo=False)
        check_no_argv_held(watch, result, marker, ranks=2)


@pytest.fixture
def worker_sshd(tmp_path):
    """A worker's sshd as run_horovod starts it (here, in this process), on 127.0.0.1; a session key
    pinned to it. Yields (port, user, ssh argv prefix)."""
    if not os.path.exists(sshd.SSHD_BINARY):
        pytest.skip("no sshd here: apt-get install openssh-server")
    keys = SessionSSH.create(str(tmp_path))
    files_before = agent_files._files_folder
    [port] = free_ports(1)
    try:
        started = sshd.start(keys.public_key, port, listen="127.0.0.1")
        known = tmp_path / "known_hosts"
        known.write_text(known_hosts_text({"127.0.0.1": started["host_key"]}, port))
        ssh = ["ssh", "-T", "-F", "/dev/null", "-p", str(port), "-i", keys.identity_file, "-o", "BatchMode=yes"]
        ssh += ["-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes"]
        yield port, started["user"], ssh
    finally:
        sshd.stop()
        keys.close()
        if agent_files._files_folder != files_before:  # made for sshd's SetEnv, as in a worker
            os.rmdir(agent_files._files_folder)
            agent_files._files_folder = files_before


def test_a_workers_sshd_listens_where_asked_admits_its_user_only_and_forwards_nothing(worker_sshd, tmp_path):
    port, user, ssh = worker_sshd
    assert sshd._running is not None
    listening = {c.laddr for c in psutil.Process(sshd._running.pid).net_connections() if c.status == "LISTEN"}
    assert {(a.ip, a.port) for a in listening} == {("127.0.0.1", port)}  # ListenAddress, not every address
    effective = subprocess.run(
        [sshd.SSHD_BINARY, "-T", "-f", os.path.join(sshd._home or "", "sshd_config")], capture_output=True, text=True
    ).stdout
    assert f"allowusers {user}" in effective and "allowtcpforwarding no" in effective

    def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ssh, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    login = f"{user}@127.0.0.1"
    ok = run(login, "echo in")
    assert ok.returncode == 0 and ok.stdout.strip() == "in", ok.stderr  # the key and host key are right

    # Another user, with the same key (sshd's AuthorizedKeysFile is one file for everyone): refused.
    other = "nobody" if user != "nobody" else "root"
    refused = run(f"{other}@127.0.0.1", "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr

    # -W (stdio forwarding) and -R (remote forwarding): refused by sshd.
    stdio = run("-W", f"127.0.0.1:{port}", login)
    assert stdio.returncode != 0 and "prohibited" in stdio.stderr, stdio.stderr
    remote = run("-o", "ExitOnForwardFailure=yes", "-N", "-R", "0:127.0.0.1:9", login)
    assert remote.returncode == 255 and "forwarding failed" in remote.stderr, remote.stderr

    # -L: the client listens here, but sshd refuses every connection through it.
    [local] = free_ports(1)
    tunnel = subprocess.Popen(
        [*ssh, "-N", "-L", f"127.0.0.1:{local}:127.0.0.1:{port}", login],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                connection = socket.create_connection(("127.0.0.1", local), timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and tunnel.poll() is None, "ssh -L did not listen"
                time.sleep(0.1)
        with connection:
            connection.settimeout(10)
            assert connection.recv(100) == b""  # closed at once: no SSH banner came through the tunnel
    finally:
        # OpenSSH 9.2's client loop checks for a signal, then poll()s with no signal mask and, with -N,
        # no timeout: a TERM landing between the two is noticed only at the next packet (ci27 hung
        # 10 s). Newer clients use ppoll(); here, KILL after a grace.
        tunnel.terminate()
        try:
            _, err = tunnel.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            tunnel.kill()
            _, err = tunnel.communicate(timeout=10)
    assert "prohibited" in err, err


def test_host_keys_trusted_on_first_use_go_to_cmlclusters_file_not_the_users(worker_sshd, tmp_path, monkeypatch):
    port, user, ssh = worker_sshd
    identity = ssh[ssh.index("-i") + 1]
    users_file = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".ssh", "known_hosts")  # what ssh itself uses
    before = open(users_file, "rb").read() if os.path.exists(users_file) else None
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    backend = SSHBackend(["127.0.0.1"], port=port, user=user, identity=identity, trust_on_first_use=True)
    ran = subprocess.run(
        [*backend.ssh_argv("127.0.0.1", "true")], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    assert ran.returncode == 0, ran.stderr
    ours = tmp_path / "home" / ".config" / "cmlcluster" / "known_hosts"
    [line] = ours.read_text().splitlines()
    pinned = (tmp_path / "known_hosts").read_text().split()[1:]  # the worker's host key, as the fixture pinned it
    assert line.split()[1:] == pinned
    found = subprocess.run(["ssh-keygen", "-F", f"[127.0.0.1]:{port}", "-f", str(ours)], capture_output=True)
    assert found.returncode == 0  # recorded for that host and port (ssh may hash the name)
    assert oct(ours.stat().st_mode & 0o777) == "0o600"
    after = open(users_file, "rb").read() if os.path.exists(users_file) else None
    assert after == before  # the user's own known_hosts: untouched
    assert not (tmp_path / "home" / ".ssh").exists()


# Starts a worker's sshd as this process's (unnamed) uid, says what it started, and stops it at EOF.
SSHD_AS_UNNAMED_UID = """
import json, sys
from cmlcluster.ssh import sshd
started = sshd.start(sys.argv[1], int(sys.argv[2]), listen="127.0.0.1")
print(json.dumps(started), flush=True)
sys.stdin.read()
sshd.stop()
"""


def test_a_workers_sshd_runs_as_a_uid_that_etc_passwd_does_not_name_and_admits_it(tmp_path):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to become another uid")
    if sshd.nss_wrapper() is None:
        pytest.fail("libnss_wrapper.so is missing: bash scripts/install.sh dev installs libnss-wrapper")
    uid = 54321
    try:
        pwd.getpwuid(uid)
        pytest.skip(f"uid {uid} is named here; the test needs one that is not")
    except KeyError:
        pass
    keys = SessionSSH.create(str(tmp_path))
    own_tmp = tempfile.mkdtemp(prefix="cmlcluster-test-uid-", dir="/tmp")  # the uid's TMPDIR
    os.chown(own_tmp, uid, uid)
    # The system's Python with copies of what sshd.py imports: the checkout and its .venv may be
    # private to root (a mktemp -d clone), where another uid cannot reach them.
    lib = os.path.join(own_tmp, "lib")
    for package in (cmlcluster, pathspec):
        source = os.path.dirname(package.__file__)
        shutil.copytree(source, os.path.join(lib, package.__name__), ignore=shutil.ignore_patterns("__pycache__"))
    python = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    [port] = free_ports(1)
    as_uid = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    child = subprocess.Popen(
        [*as_uid, python, "-c", SSHD_AS_UNNAMED_UID, keys.public_key, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ["PATH"], "TMPDIR": own_tmp, "HOME": own_tmp, "PYTHONPATH": lib},
    )
    try:
        line = child.stdout.readline()
        assert line, child.communicate(timeout=10)[1]
        started = json.loads(line)
        assert started["user"] == sshd.UNNAMED_USER
        known = tmp_path / "known_hosts"
        known.write_text(known_hosts_text({"127.0.0.1": started["host_key"]}, port))
        ran = subprocess.run(
            [
                "ssh",
                "-T",
                "-F",
                "/dev/null",
                "-p",
                str(port),
                "-i",
                keys.identity_file,
                "-o",
                "BatchMode=yes",
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                f"UserKnownHostsFile={known}",
                "-o",
                "StrictHostKeyChecking=yes",
                f"{started['user']}@127.0.0.1",
                "id -u; echo $USER",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == [str(uid), sshd.UNNAMED_USER]
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        keys.close()
        shutil.rmtree(own_tmp, ignore_errors=True)
