"""Runs inside a worker: an sshd on port 2222 that lets in exactly one key, this session's.

Key-only (no passwords, no keyboard-interactive), a host key made for this worker
at start (its public half goes back to the session, which pins it), everything in
a private folder. sshd is a child of the worker's agent, in its process group, so
it ends with the worker. It runs as the worker's user, root or not, and lets in only that
user (AllowUsers), on the address peers use, with every kind of forwarding off.

sshd admits only users it can look up. A worker may run as a uid the image's /etc/passwd does
not name (Docker workers as the notebook user's uid, pods under OpenShift's random uid): then
sshd runs under libnss_wrapper, with a passwd file of its own that names the worker's uid.
"""

from __future__ import annotations

import contextlib
import glob
import grp
import ipaddress
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from .. import wire
from .._proc import descendants
from ..agent import files as agent_files
from .config import MAX_WORKER_ADDRESSES, sshd_config_text
from .keys import new_ed25519

SSHD_BINARY = "/usr/sbin/sshd"
NSS_WRAPPER_PATTERNS = ("/usr/lib/*/libnss_wrapper.so", "/usr/lib64/libnss_wrapper.so", "/usr/lib/libnss_wrapper.so")
UNNAMED_USER = "cmlcluster"  # the name a uid without a passwd entry gets in sshd's own passwd file
RANK_ENV_FILE = "rank_env.json"  # the run's env=, in sshd's folder (wire.RANK_ENV_FILE_ENV names it to ranks)
_running: subprocess.Popen[bytes] | None = None
_home: str | None = None  # sshd's private folder (in the worker's own temp folder)


def start(authorized_key: str, port: int = 2222, listen: str | None = None) -> dict[str, object]:
    """Start sshd on `port` admitting `authorized_key`, for this worker's user only.

    listen: the address the session and the other workers reach this worker at (the session
    learns it from the worker's route to it, so it passes it here); sshd listens there only.
    Without it sshd listens on every address: a worker alone cannot tell which one its peers use.

    Returns this worker's host public key, the user to log in as, the working folder that
    commands run through this sshd start in (see cmlcluster.horovod.rank), this worker's
    interface addresses (interface_addresses): a rank started here may dial the session from any,
    and the name of the interface that holds `listen` (interface_of; None without it): horovodrun
    is told it, so it never probes the hosts' interfaces (cmlcluster.horovod.commands.common_interface).
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
    user, env = _user_and_env(home)
    config = os.path.join(home, "sshd_config")
    with open(config, "w") as f:
        f.write(sshd_config_text(home, port, user, _session_env(home), listen))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # root's sshd drops privileges there
    _running = subprocess.Popen([sshd, "-D", "-e", "-f", config], env=env)  # output joins the worker's
    _wait_listening(listen or "127.0.0.1", port, _running)
    return {
        "host_key": host_public,
        "user": user,
        "addresses": interface_addresses(),
        "interface": interface_of(listen) if listen is not None else None,
    }


def interface_of(address: str) -> str | None:
    """The name of this worker's interface that holds `address` ("eth0"), or None: no interface
    holds it (an address translated on the way) or psutil is missing."""
    try:
        import psutil

        wanted = ipaddress.ip_address(address.split("%")[0])
    except (ImportError, ValueError):
        return None
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                        return name
    return None


def interface_addresses() -> list[str]:
    """This worker's own addresses on every interface but loopback, IPv4 first, at most MAX_WORKER_ADDRESSES.

    A rank dials horovodrun's rendezvous from its address on the interface horovodrun picked (an
    InfiniBand or second Ethernet NIC), which need not be the one the session reaches this worker
    at; the rendezvous admits the job's hosts by these (cmlcluster.horovod.rendezvous). Empty
    without psutil (Horovod's own requirement, so a Horovod worker has it): then only that one."""
    try:
        import psutil
    except ImportError:
        return []
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            with contextlib.suppress(ValueError):
                address = ipaddress.ip_address(a.address.split("%")[0])  # fe80::1%eth0: the zone is no part of it
                if not (address.is_loopback or address.is_unspecified or address.is_multicast):
                    found.add(address)
    ordered = sorted(found, key=lambda a: (a.version, a.packed))
    return [str(a) for a in ordered[:MAX_WORKER_ADDRESSES]]


def _user_and_env(home: str) -> tuple[str, dict[str, str] | None]:
    """The user sshd admits, and sshd's environment (None: this process's). A uid /etc/passwd names
    is that user; one it does not is named in a passwd file of sshd's own, which sshd (and only sshd,
    not the commands it runs) reads through libnss_wrapper."""
    uid, gid = os.getuid(), os.getgid()
    try:
        return pwd.getpwuid(uid).pw_name, None
    except KeyError:
        pass
    library = nss_wrapper()
    if library is None:
        raise RuntimeError(
            f"this worker runs as uid {uid}, which /etc/passwd does not name, and sshd admits only users it "
            "can look up: install libnss-wrapper in the worker's image (apt-get install libnss-wrapper), or "
            f"add a user with uid {uid} to it"
        )
    shell = "/bin/sh"
    home_dir = os.environ.get("HOME") or home
    files = {
        "passwd": _read("/etc/passwd") + f"{UNNAMED_USER}:x:{uid}:{gid}:cmlcluster worker:{home_dir}:{shell}\n",
        "group": _read("/etc/group") + ("" if _group_named(gid) else f"{UNNAMED_USER}:x:{gid}:\n"),
    }
    for name, text in files.items():
        with open(os.open(os.path.join(home, name), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(text)
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=library,
        NSS_WRAPPER_PASSWD=os.path.join(home, "passwd"),
        NSS_WRAPPER_GROUP=os.path.join(home, "group"),
    )
    return UNNAMED_USER, env


def nss_wrapper() -> str | None:
    """The path of libnss_wrapper.so in this worker, or None."""
    for pattern in NSS_WRAPPER_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def _group_named(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
        return True
    except KeyError:
        return False


def _read(path: str) -> str:
    """A file's text ending in a newline, or "" when it is missing."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    return text if not text or text.endswith("\n") else text + "\n"


def set_rank_env(env: dict[str, str]) -> str:
    """The env= of the run about to start: written to a file only this user may read (0600), which
    every rank started through this sshd reads (cmlcluster.horovod.rank, told by wire.RANK_ENV_FILE_ENV).
    Never on a command line: horovodrun would put them on each rank's ssh command line, which `ps`
    shows every user of both hosts. Returns the file's path."""
    if _home is None:
        raise RuntimeError("sshd was not started in this worker; call cmlcluster.ssh.sshd:start first")
    path = os.path.join(_home, RANK_ENV_FILE)
    write_env_file(path, env)
    return path


def write_env_file(path: str, env: dict[str, str]) -> None:
    """`env` as a JSON object in `path`, readable by this user alone, replacing what was there."""
    temporary = f"{path}.{os.getpid()}.new"
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(dict(env), f)
    os.replace(temporary, path)  # a rank reading it sees the whole of the old or of the new


def _session_env(home: str) -> dict[str, str]:
    """SetEnv's variables: logins through this sshd (ranks) run where the worker runs, find what was
    shipped to it and the run's env= file, keep their temp files in its folder, and see its GPUs."""
    env = {
        "CMLCLUSTER_WORKDIR": os.getcwd(),
        "CMLCLUSTER_FILES": agent_files.files_folder(),
        wire.RANK_ENV_FILE_ENV: os.path.join(home, RANK_ENV_FILE),
    }
    env.update({k: os.environ[k] for k in ("TMPDIR", "CUDA_VISIBLE_DEVICES") if k in os.environ})
    return env


def _wait_listening(address: str, port: int, process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with code {process.returncode} (its output is above)")
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd did not listen on {address} port {port} within {timeout:g} s")


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
