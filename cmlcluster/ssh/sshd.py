"""Runs inside a worker: an sshd on port 2222 that lets in exactly one key, this session's.

Key-only (no passwords, no keyboard-interactive), a host key made for this worker
at start (its public half goes back to the session, which pins it), everything in
a private folder. sshd is a child of the worker's agent, in its process group, so
it ends with the worker. It runs as the worker's user, root or not: a non-root sshd
lets in only its own user, which is all a session needs.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from .. import agent_files
from .._proc import descendants
from .keys import new_ed25519

SSHD_BINARY = "/usr/sbin/sshd"
_running: subprocess.Popen[bytes] | None = None
_home: str | None = None  # sshd's private folder (in the worker's own temp folder)


def start(authorized_key: str, port: int = 2222) -> dict[str, str]:
    """Start sshd on `port` admitting `authorized_key`.

    Returns this worker's host public key, the user to log in as, and the working folder
    that commands run through this sshd start in (see cmlcluster.horovod.rank).
    """
    global _running, _home
    if _running is not None and _running.poll() is None:
        raise RuntimeError(f"sshd already runs in this worker (pid {_running.pid})")
    sshd = shutil.which("sshd") or SSHD_BINARY
    if not os.path.exists(sshd):
        raise RuntimeError(f"{SSHD_BINARY} is missing in this worker's image; install openssh-server in it")
    home = _home = tempfile.mkdtemp(prefix="cmlcluster-sshd-")
    host_private, host_public = new_ed25519(comment="cmlcluster-worker")
    files = {"host_key": host_private, "authorized_keys": authorized_key.strip() + "\n"}
    for name, text in files.items():
        with open(os.open(os.path.join(home, name), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(text)
    config = os.path.join(home, "sshd_config")
    with open(config, "w") as f:
        f.write(
            f"Port {port}\n"
            f"HostKey {home}/host_key\n"
            f"AuthorizedKeysFile {home}/authorized_keys\n"
            f"PidFile {home}/sshd.pid\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\n"
            "PermitEmptyPasswords no\n"
            "UsePAM no\n"
            "StrictModes no\n"  # the folder is the agent's own, mode 0700
            "X11Forwarding no\n"
            "AllowAgentForwarding no\n"
            "PermitUserEnvironment no\n"
            f"SetEnv {_session_env()}\n"
            "LogLevel ERROR\n"
        )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # root's sshd drops privileges there
    _running = subprocess.Popen([sshd, "-D", "-e", "-f", config])  # output joins the worker's
    _wait_listening(port, _running)
    return {"host_key": host_public, "user": getpass.getuser(), "workdir": os.getcwd()}


def _session_env() -> str:
    """SetEnv's words: logins through this sshd (ranks) run where the worker runs, find what was
    shipped to it, keep their temp files in its folder, and see its GPUs."""
    env = {"CMLCLUSTER_WORKDIR": os.getcwd(), "CMLCLUSTER_FILES": agent_files.files_folder()}
    env.update({k: os.environ[k] for k in ("TMPDIR", "CUDA_VISIBLE_DEVICES") if k in os.environ})
    return " ".join(f'"{name}={value}"' for name, value in env.items())


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with code {process.returncode} (its output is above)")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd did not listen on port {port} within {timeout:g} s")


def end_sessions() -> int:
    """Kill every process started through this worker's sshd (ranks of an earlier run); sshd stays.

    Without a terminal, a rank whose horovodrun was stopped does not get SIGHUP when its ssh
    connection closes, and a rank waiting in an allreduce would wait for the dead peer.
    Returns how many processes were killed.
    """
    if _running is None or _running.poll() is not None:
        return 0
    doomed = descendants(_running.pid)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(doomed)


def stop() -> None:
    global _running, _home
    if _running is not None:
        _running.terminate()
        _running.wait()
        _running = None
    if _home is not None:
        shutil.rmtree(_home, ignore_errors=True)
        _home = None
