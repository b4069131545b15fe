"""Test hosts for the SSH-hosts backend: containers that stand in for machines reached over SSH.

A test host is a container on a user-defined bridge network, with its own IP, running OpenSSH's
sshd on port 22 with key-only logins for one ordinary user, `alice` (uid 1000). The test process
(the session) logs into it with the `ssh` client, a private key made for the run, and a
known_hosts file that pins each host's key, exactly as it would log into a real machine.

The image is the bare test root folder (scripts/docker_engine.sh); programs come from this
machine's own /usr and Python environment, bind-mounted read-only at the same paths, so a host
runs the session's interpreter without an image build. cmlcluster is mounted alone (its package
folder, not the repository), because the point of these hosts is that the session's files are
not there: whatever a worker needs must travel over SSH. That is enough to import it because it
is installed editable: the venv's `__editable__` finder maps the name `cmlcluster` to the package
folder's absolute path. With `with_cmlcluster=False` the folder is not mounted, the finder finds
nothing, and `import cmlcluster` fails on the hosts.

Everything alice needs (her passwd entry, home, authorized_keys) and sshd's host key and config
are made at container start by a short root shell script, which then execs sshd. The key folder
is named sshhosts-*, not cmlcluster-*, so that hosts kept across tests are not taken for leaks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmlcluster.backends.base import run_tag_labels

IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
USER = "alice"
CONTAINER_LABEL = "cmlcluster.testhost"  # the per-test leak check leaves these: they serve the whole run
OWNER_LABEL = "cmlcluster.testhost.pid"  # the test process that started it
NETWORK_LABEL = "cmlcluster.testhosts"
SSHD_CONFIG = "/etc/ssh/sshd_config_test"
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"
START_TIMEOUT = 30.0

SSHD_CONFIG_TEXT = f"""\
Port 22
HostKey {HOST_KEY}
PidFile /run/sshd_test.pid
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UsePAM no
PrintMotd no
PrintLastLog no
X11Forwarding no
MaxStartups 100
MaxSessions 100
Subsystem sftp /usr/lib/openssh/sftp-server
"""
# MaxStartups/MaxSessions: tests open many connections at once; sshd's defaults drop some.
# sftp: scp speaks SFTP since OpenSSH 9.0.

# Runs as root at container start; prints sshd's pid (exec keeps the shell's) and the host key.
START_SCRIPT = f"""\
set -eu
echo '{USER}:x:1000:1000:{USER}:/home/{USER}:/bin/bash' >> /etc/passwd
echo '{USER}:x:1000:' >> /etc/group
echo '{USER}:*:19000:0:99999:7:::' >> /etc/shadow
install -d -m 700 -o 1000 -g 1000 /home/{USER} /home/{USER}/.ssh
(umask 077; printf '%s\\n' "$AUTHORIZED_KEY" > /home/{USER}/.ssh/authorized_keys)
chown 1000:1000 /home/{USER}/.ssh/authorized_keys
install -d -m 755 /etc/ssh /run/sshd
chmod 1777 /tmp
ssh-keygen -q -t ed25519 -N '' -C "$(hostname)" -f {HOST_KEY}
printf '%s' "$SSHD_CONFIG" > {SSHD_CONFIG}
echo "pid $$"
cat {HOST_KEY}.pub
exec /usr/sbin/sshd -D -e -f {SSHD_CONFIG}
"""


@dataclass
class TestHost:
    """One host: a container with sshd on port 22 at `ip`."""

    __test__ = False  # a class named Test* that pytest must not collect where it is imported

    name: str
    ip: str
    container_id: str
    sshd_pid: int = field(default=0, repr=False)  # the port-22 listener, inside the container
    _container: Any = field(default=None, repr=False, compare=False)

    def exec(self, *argv: str, user: str = "root") -> subprocess.CompletedProcess:
        """Run argv in the host (docker exec, no shell), as `user`; output captured as text."""
        code, (out, err) = self._container.exec_run(list(argv), user=user, demux=True)
        return subprocess.CompletedProcess(
            list(argv), code, (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace")
        )

    def processes(self) -> list[str]:
        """`pid user args` of every process in the host but docker-init, sshd's listener and the ps itself."""
        ps = ["ps", "-eo", "pid,user,args"]
        result = self.exec(*ps)
        if result.returncode != 0:
            raise RuntimeError(f"{self.name}: ps failed: {result.stderr.strip()}")
        found = []
        for line in result.stdout.splitlines()[1:]:
            pid, _, rest = line.strip().partition(" ")
            args = rest.strip().partition(" ")[2].strip()
            if int(pid) in (1, self.sshd_pid) or args == " ".join(ps):
                continue
            found.append(line.strip())
        return found

    def kill(self) -> None:
        """Drop the host: SIGKILL everything and remove the container, so its IP goes away too."""
        from docker.errors import NotFound

        with contextlib.suppress(NotFound):
            self._container.remove(force=True)


@dataclass
class TestHosts:
    """Hosts from start_hosts(), and what the session needs to log into them as `user`."""

    __test__ = False

    hosts: list[TestHost]
    user: str
    identity_file: str  # the session's private key (ed25519, 0600)
    known_hosts: str  # pins every host's port-22 key: "ip ssh-ed25519 AAAA..."
    python: str  # the interpreter path on the hosts
    network: str = ""
    gateway: str = ""  # this machine's address on the network; hosts reach the session there
    _client: Any = field(default=None, repr=False, compare=False)
    _tempdir: str = field(default="", repr=False, compare=False)
    _created_network: bool = field(default=False, repr=False, compare=False)

    def ssh_argv(self, host: TestHost, *command: str, options: Sequence[str] = ()) -> list[str]:
        """An ssh command line that logs into `host` as `user` the strict way: pinned key, no prompts.

        `options` ("-o", "Name=value", ...) go first, because ssh keeps the first value it is given.
        """
        return [
            "ssh",
            *options,
            "-i",
            self.identity_file,
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            f"{self.user}@{host.ip}",
            *command,
        ]

    def close(self) -> None:
        """Remove the containers, the network if start_hosts() made it, and the key folder."""
        if self._client is not None:
            with ThreadPoolExecutor(max_workers=max(1, len(self.hosts))) as pool:
                list(pool.map(TestHost.kill, self.hosts))
            if self._created_network:
                # Other hosts (another run's) may still be on it; then the last one out removes it.
                with contextlib.suppress(Exception):
                    self._client.networks.get(self.network).remove()
            self._client.close()
            self._client = None
        if self._tempdir:
            shutil.rmtree(self._tempdir, ignore_errors=True)
            self._tempdir = ""

    def __enter__(self) -> TestHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_mounts(with_cmlcluster: bool) -> list[str]:
    """Read-only bind mounts ("path:path:ro") that give a host this machine's Python, at the same paths.

    /usr carries the programs (sshd, ssh-keygen, bash, ps); the interpreter's base prefix and the
    venv may lie elsewhere (here under /root and the repository). cmlcluster is installed editable:
    the venv's __editable__ finder maps the name to the package folder's absolute path, so mounting
    that folder alone, at the same path, makes it importable without the rest of the repository.
    """
    spec = importlib.util.find_spec("cmlcluster")  # found, not imported: the package may be mid-edit
    assert spec is not None and spec.origin, "cmlcluster is not installed in this environment"
    package = os.path.dirname(os.path.abspath(spec.origin))
    roots: list[str] = []
    for path in map(os.path.abspath, ("/usr", sys.base_prefix, sys.prefix)):
        if not any(_within(path, root) for root in roots):
            roots.append(path)
    if any(_within(package, root) for root in roots):
        # A regular install inside the venv: an empty folder over it would still import, as a namespace package.
        if not with_cmlcluster:
            raise RuntimeError(f"with_cmlcluster=False needs cmlcluster outside the mounted {roots}: {package}")
    elif with_cmlcluster:
        roots.append(package)
    return [f"{path}:{path}:ro" for path in roots]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def start_hosts(
    n: int = 3, *, with_cmlcluster: bool = True, network: str = "", volumes: Sequence[str] = ()
) -> TestHosts:
    """Start n test hosts on `network` (created when missing; by default one of their own, so that runs
    and pytest-xdist's workers may each have hosts at once) and return them once sshd answers on each.
    `volumes`: more bind mounts ("path:path:ro"), such as a test Slurm cluster's folder for a login node.

    The caller must close() the result (or use it as a context manager).
    """
    import docker

    client = docker.from_env(timeout=60, max_pool_size=max(10, n + 2))
    tempdir = tempfile.mkdtemp(prefix="sshhosts-")  # not cmlcluster-*: the leak checker watches those
    network = network or f"cmlcluster-hosts-{uuid.uuid4().hex[:12]}"
    hosts = TestHosts(
        hosts=[],
        user=USER,
        identity_file=os.path.join(tempdir, "id_ed25519"),
        known_hosts=os.path.join(tempdir, "known_hosts"),
        python=sys.executable,
        network=network,
        _client=client,
        _tempdir=tempdir,
    )
    try:
        _remove_orphans(client)
        hosts._created_network, hosts.gateway = _ensure_network(client, network)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "cmlcluster-testhosts", "-f", hosts.identity_file],
            check=True,
            capture_output=True,
        )
        with open(hosts.identity_file + ".pub") as f:
            public_key = f.read().strip()
        run_id = secrets.token_hex(3)
        options = {
            "image": IMAGE,
            "command": ["/bin/sh", "-c", START_SCRIPT],
            "environment": {"AUTHORIZED_KEY": public_key, "SSHD_CONFIG": SSHD_CONFIG_TEXT},
            "network": network,
            "labels": {CONTAINER_LABEL: "1", OWNER_LABEL: str(os.getpid()), **run_tag_labels()},
            "volumes": [*host_mounts(with_cmlcluster), *volumes],
            "init": True,  # signals reach sshd, and orphans are reaped
            "detach": True,
        }

        def start(i: int) -> TestHost:
            name = f"cmlcluster-testhost-{run_id}-{i}"
            container = client.containers.run(name=name, hostname=name, **options)
            # Registered at once, so close() removes it even if it never comes up.
            host = TestHost(name=name, ip="", container_id=container.id, _container=container)
            hosts.hosts.append(host)
            _wait_up(host, network)
            return host

        with ThreadPoolExecutor(max_workers=n) as pool:
            started = list(pool.map(start, range(n)))
        hosts.hosts = started  # in order; the list was filled as they came up
        keys = [_host_key(h) for h in started]
        with open(hosts.known_hosts, "w") as f:
            f.writelines(f"{h.ip} {key}\n" for h, key in zip(started, keys, strict=True))
    except BaseException:
        hosts.close()
        raise
    return hosts


def _remove_orphans(client: Any) -> None:
    """Remove test hosts whose test process is gone (a run killed before its teardown)."""
    for container in client.containers.list(all=True, filters={"label": CONTAINER_LABEL}):
        owner = int(container.labels.get(OWNER_LABEL, "0"))
        if not owner or not os.path.exists(f"/proc/{owner}"):
            with contextlib.suppress(Exception):
                container.remove(force=True)


def _ensure_network(client: Any, network: str) -> tuple[bool, str]:
    """(whether it was made here, its IPv4 gateway) for a user-defined bridge network, made when missing."""
    from docker.errors import APIError, NotFound

    created = False
    try:
        net = client.networks.get(network)
    except NotFound:
        try:
            net = client.networks.create(network, driver="bridge", check_duplicate=True, labels={NETWORK_LABEL: "1"})
            created = True
        except APIError:  # another run made it meanwhile
            net = client.networks.get(network)
    net.reload()
    for config in (net.attrs.get("IPAM") or {}).get("Config") or []:
        gateway = config.get("Gateway", "")
        if gateway and ":" not in gateway:
            return created, gateway
    raise RuntimeError(f"network {network!r} has no IPv4 gateway")


def _wait_up(host: TestHost, network: str) -> None:
    """Fill in host.ip and host.sshd_pid, and wait for sshd's banner on port 22."""
    container = host._container
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        container.reload()
        if container.status not in ("created", "running"):
            raise RuntimeError(f"{host.name} exited at start:\n{container.logs().decode(errors='replace')}")
        host.ip = container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]
        if host.ip and _ssh_banner(host.ip):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host.name}: no sshd on {host.ip}:22:\n{container.logs().decode(errors='replace')}")
        time.sleep(0.05)
    for line in container.logs(stdout=True, stderr=False).decode().splitlines():
        if line.startswith("pid "):
            host.sshd_pid = int(line.split()[1])


def _ssh_banner(ip: str) -> bool:
    """Whether an SSH server answers on ip:22 (it speaks first)."""
    try:
        with socket.create_connection((ip, 22), timeout=1) as s:
            return s.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _host_key(host: TestHost) -> str:
    """The host's port-22 public key as "type base64", read from its start output."""
    for line in host._container.logs(stdout=True, stderr=False).decode().splitlines():
        if line.startswith("ssh-ed25519 "):
            return " ".join(line.split()[:2])
    raise RuntimeError(f"{host.name}: no host key in its start output")
