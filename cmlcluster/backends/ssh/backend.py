"""Workers on a list of hosts reached over SSH: machines you already have, as in an MPI machinefile.

    cdsw.use_backend("ssh", hosts=["10.0.0.5", "10.0.0.6:2"], user="alice", identity="~/.ssh/id_ed25519")
    cdsw.use_backend("ssh", hostfile="machinefile")     # "host slots=N" or "host:N" lines

Each worker is started by one `ssh host python -m cmlcluster.backends.ssh.remote` process here.
Over that connection's stdin the remote side receives the worker's environment (so nothing secret
is on a command line) and, later, the order to stop; it runs the agent as a process group of its
own in a private folder, under a relay that outlives the connection, and ends everything the
worker started when told to, or when the session dies (then the agent's heartbeat watchdog does it
too). A connection that drops is made again (ssh/attach.py); output comes back through ssh into the
session's folder, like a local worker's, once and in order.

OpenSSH's client does the connecting, so the user's keys, agent and ssh config work as they do
in a terminal. Host keys are checked against known_hosts: an unknown or changed key is refused,
unless trust_on_first_use=True is asked for by name. A worker is reported lost only once its host
has been silent for the session's silence_timeout; then that host's workers fail, and no other.

Workers are placed on the host with the most free slots that has the GPUs they ask for; a
launch that cannot fit is refused before anything starts. Before the first worker starts, every
host is checked at once: login, the interpreter, and cmlcluster's version there.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ... import checks
from ..._version import __version__
from ...errors import BackendError, ConfigError, host_install_hint
from ...ports import route_address
from ...ssh.client import SSHClient, key_files
from ...ssh.config import keepalive_seconds
from ...ssh.keys import tofu_known_hosts
from ...wire import DEFAULT_SILENCE_TIMEOUT
from ...workers import Resources, WorkerSpec
from ..base import Backend, Capabilities, SessionContext, log_tail, signal_exit_code
from . import collect
from .attach import CONNECT_TIMEOUT, RemoteWorker

PREFLIGHT_TIMEOUT = 30.0
HOST_LINE = re.compile(r"^(?P<host>[^\s:#]+|\[[^\]]+\])(?::(?P<colon>\d+))?(?:\s+slots\s*=\s*(?P<slots>\d+))?$")


@dataclass
class Host:
    """One machine: where to log in, how many workers it takes (slots), and its GPU ids."""

    address: str
    slots: int
    gpus: list[str] = field(default_factory=list)
    free_slots: int = 0
    free_gpus: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_slots = self.slots
        self.free_gpus = list(self.gpus)


def parse_hosts(hosts: Sequence[str] | None = None, hostfile: str | None = None) -> list[tuple[str, int]]:
    """[(host, slots)] from "host[:slots]" entries (horovodrun's -H) or a machinefile ("host slots=N")."""
    if (hosts is None) == (hostfile is None):
        raise ConfigError(
            'give hosts=["10.0.0.5", "10.0.0.6:2"] or hostfile="machinefile" (or set CMLCLUSTER_SSH_HOSTFILE), '
            "one of the two"
        )
    if hostfile is not None:
        try:
            with open(os.path.expanduser(hostfile)) as f:
                lines = [line.split("#", 1)[0].strip() for line in f]
        except OSError as e:
            why = e.strerror or e
            raise ConfigError(f"hostfile={hostfile!r}: {why}; give a file of 'host slots=N' lines") from None
        entries = [(line, f"{hostfile}: {line!r}") for line in lines if line]
    else:
        if isinstance(hosts, str):
            hosts = [h for h in hosts.replace(",", " ").split() if h]
        entries = [(str(h).strip(), f"hosts entry {h!r}") for h in hosts or []]
    parsed: list[tuple[str, int]] = []
    for text, where in entries:
        match = HOST_LINE.match(text)
        if not match or (match.group("colon") and match.group("slots")):
            raise ConfigError(f"{where}: write 'host', 'host:slots' or 'host slots=N'")
        slots = int(match.group("colon") or match.group("slots") or 1)
        if slots < 1:
            raise ConfigError(f"{where}: a host needs 1 or more slots")
        host = re.sub(r"^\[(.*)\]$", r"\1", match.group("host"))  # "[IPv6 address]" as the address
        if not checks.host(host):  # a leading '-' would be an ssh option
            raise ConfigError(
                f"{where}: {host!r} is not a host name or address (no leading '-', brackets, spaces, '@' or "
                "shell characters); give the login name as user="
            )
        if host in (h for h, _ in parsed):
            raise ConfigError(f"{where}: host {host!r} is listed twice; give it once with all its slots")
        parsed.append((host, slots))
    if not parsed:
        raise ConfigError(f"no hosts in {'hostfile=' + repr(hostfile) if hostfile else 'hosts='}; list at least one")
    return parsed


@dataclass(eq=False)
class SSHHandle:
    remote: RemoteWorker  # its connections to the host, and what they brought
    host: Host
    gpus: list[str]
    log_path: str
    released: bool = False
    spec: WorkerSpec | None = None  # what it was started for: its collect= files come home (ssh/collect.py)


class SSHBackend(Backend[SSHHandle]):
    """Options:

    hosts / hostfile: where workers run (see parse_hosts); one worker per slot. Without either,
        the hostfile named by CMLCLUSTER_SSH_HOSTFILE.
    user: the login name on the hosts (default: ssh's, from your ssh config or your own name).
    port: sshd's port on the hosts (22).
    identity: a private key file to log in with; default: your ssh agent and keys, as ssh finds
        them. Never copied anywhere.
    known_hosts: the known_hosts file that pins the hosts' keys (default: ssh's own). An unknown
        or changed key is refused.
    trust_on_first_use: accept the key of a host seen for the first time, recorded in known_hosts=
        or else in cmlcluster's own file (~/.config/cmlcluster/known_hosts, never ~/.ssh/known_hosts);
        a changed key is still refused. Off unless asked for.
    python: the interpreter on the hosts, with cmlcluster installed ("python3").
    gpus: {host: [GPU ids]} for hosts with GPUs.
    controller_ip: the session's address as the hosts reach it (default: this machine's address
        on its route to the first host).
    ssh_options: extra "-o Name=value" options for ssh, e.g. ["ProxyJump=bastion"].
    network_interfaces: the interface names ranks talk over ("ens5", "ib0"), for horovodrun and mpirun.
        Default: for run_horovod, the interface each host's worker reports holding its address toward
        the session, when every host names it alike (a run on hosts that differ asks for this option).
    """

    name = "ssh"

    def __init__(
        self,
        hosts: Sequence[str] | None = None,
        *,
        hostfile: str | None = None,
        user: str | None = None,
        port: int = 22,
        identity: str | None = None,
        known_hosts: str | None = None,
        trust_on_first_use: bool = False,
        python: str = "python3",
        gpus: Mapping[str, Sequence[str]] | None = None,
        controller_ip: str | None = None,
        ssh_options: Sequence[str] = (),
        network_interfaces: Sequence[str] = (),
    ):
        if hosts is None and hostfile is None:
            hostfile = os.environ.get("CMLCLUSTER_SSH_HOSTFILE")  # with CMLCLUSTER_BACKEND=ssh: no code at all
        parsed = parse_hosts(hosts, hostfile)
        if not checks.port(port):
            raise ConfigError(f"port={port!r}: give the TCP port sshd listens on, on the hosts (22)")
        identity, known_hosts = key_files(identity, known_hosts)
        unknown = sorted(set(gpus or {}) - {h for h, _ in parsed})
        if unknown:
            raise ConfigError(f"gpus= names {unknown}, which are not among the hosts; use the names given in hosts")
        bad = [n for n in network_interfaces if not checks.interface_name(n)]
        if isinstance(network_interfaces, str) or bad:
            raise ConfigError(
                f"network_interfaces={network_interfaces!r}: give a list of interface names, e.g. ['ens5']"
            )
        self.network_interfaces = tuple(network_interfaces)
        self.hosts = [Host(h, slots, [str(g) for g in (gpus or {}).get(h, ())]) for h, slots in parsed]
        self.user = user
        self.port = port
        self.identity = identity
        self.known_hosts = known_hosts
        self.trust_on_first_use = trust_on_first_use
        self.python = python
        self.ssh_options = list(ssh_options)
        self._controller_ip = controller_ip
        self._checked = False
        self._ran_on: dict[str, Host] = {}  # worker id -> its host, for its replacement
        self.silence_timeout = DEFAULT_SILENCE_TIMEOUT  # the session's, from attach(): ssh's keepalives

    # ---------------------------------------------------------------- what it is

    def capabilities(self) -> Capabilities:
        # Workers on one host share its address; nothing of the session's disk is theirs, but what they write
        # under collect= comes home (ssh/collect.py). A replacement goes to the host its lost worker ran on, where
        # that has room again (it does: the lost one's slot).
        return Capabilities(
            own_address=False,
            session_host=False,
            python=self.python,
            shared_paths=(),
            stable_addresses=True,
            collects=True,
            interfaces=self.network_interfaces,
        )

    def controller_ip(self) -> str:
        if self._controller_ip is None:
            self._controller_ip = _route_address(self.hosts[0].address)
        return self._controller_ip

    async def _bring_home(self, handle: SSHHandle) -> None:
        """Its collect= files, from its host (ssh/collect.py), once its connection has ended."""
        address = handle.host.address
        python_on_host = functools.partial(self.ssh_argv, address, self.python)
        await collect.over_ssh(handle.spec, self.capabilities(), self.context, address, python_on_host)

    def ssh_argv(self, host: str, *command: str, connect_timeout: int = CONNECT_TIMEOUT) -> list[str]:
        """The ssh command line that runs `command` on `host` (ssh/client.py)."""
        client = SSHClient(
            self.user, self.port, self.identity, self.known_hosts, self.trust_on_first_use, self.ssh_options,
            self.silence_timeout,
        )  # fmt: skip
        return client.argv(host, *command, connect_timeout=connect_timeout)

    # ---------------------------------------------------------------- before anything starts

    async def check(self, n: int, resources: Resources) -> None:
        self._fit(n, resources)  # raises when they do not fit

    def _fit(self, n: int, resources: Resources, prefer: Host | None = None) -> list[Host]:
        """Hosts for n workers (`prefer` if it fits, then most free slots first, with the GPUs asked
        for), without taking them."""
        free = {id(h): (h.free_slots, len(h.free_gpus)) for h in self.hosts}
        chosen: list[Host] = []
        for _ in range(n):
            fitting = [h for h in self.hosts if free[id(h)][0] >= 1 and free[id(h)][1] >= resources.nvidia_gpu]
            if not fitting:
                listing = ", ".join(f"{h.address}: {h.free_slots} slots, {len(h.free_gpus)} GPUs" for h in self.hosts)
                gpus = f" with {resources.nvidia_gpu} GPUs each" if resources.nvidia_gpu else ""
                raise ConfigError(
                    f"n={n} workers{gpus} do not fit on the hosts (free now: {listing}); "
                    "ask for fewer workers or GPUs, stop workers that hold slots, or add hosts"
                )
            host = prefer if prefer in fitting else max(fitting, key=lambda h: free[id(h)][0])
            slots, gpus_free = free[id(host)]
            free[id(host)] = (slots - 1, gpus_free - resources.nvidia_gpu)
            chosen.append(host)
        return chosen

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        self.silence_timeout = context.silence_timeout
        if not self._checked:
            await asyncio.to_thread(self.preflight)
            self._checked = True

    def preflight(self) -> None:
        """Log in to every host at once; check its Python and cmlcluster's version; one error lists all."""
        probe = "import sys, cmlcluster; print('cmlcluster', cmlcluster.__version__, sys.version.split()[0])"

        def check(host: Host) -> str | None:
            import subprocess

            try:
                ran = subprocess.run(
                    self.ssh_argv(host.address, self.python, "-c", probe),
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=PREFLIGHT_TIMEOUT,
                )
            except subprocess.TimeoutExpired:
                return f"no answer within {PREFLIGHT_TIMEOUT:g} s"
            except FileNotFoundError:
                return "the ssh client is missing here: apt-get install openssh-client"
            return self._explain_preflight(ran.returncode, ran.stdout, ran.stderr)

        with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
            problems = {h.address: p for h, p in zip(self.hosts, pool.map(check, self.hosts), strict=True) if p}
        if problems:
            listing = "\n".join(f"  {host}: {why}" for host, why in problems.items())
            raise ConfigError(f"{len(problems)} of {len(self.hosts)} SSH hosts cannot run workers:\n{listing}")

    def _explain_preflight(self, code: int, out: str, err: str) -> str | None:
        found = re.search(r"^cmlcluster (\S+) (\S+)$", out, re.MULTILINE)
        if code == 0 and found:
            if found.group(1) != __version__:
                return (
                    f"it has cmlcluster {found.group(1)}, this session {__version__}; install the same version "
                    f"there: {host_install_hint(self.python)}"
                )
            return None
        last = (err.strip().splitlines() or [f"exit code {code}"])[-1]
        if "Host key verification failed" in err or "REMOTE HOST IDENTIFICATION HAS CHANGED" in err:
            tofu = f"{tofu_known_hosts()} or " if self.trust_on_first_use else ""
            where = self.known_hosts or f"{tofu}~/.ssh/known_hosts"
            return (
                f"its host key is unknown or not the one in {where} (refused). Add the host's key there after "
                "checking it (ssh-keyscan, then compare fingerprints), or pass trust_on_first_use=True for a "
                "host seen for the first time"
            )
        if "Permission denied" in err:
            return f"login refused ({last}); pass user= and identity=, or load the key into your ssh agent"
        if "No module named" in err and "cmlcluster" in err:
            return (
                f"cmlcluster is not installed for {self.python} there; install it on every host: "
                f"{host_install_hint(self.python)} (or pass python= for an interpreter that has it)"
            )
        if code == 127 or "not found" in err:
            return f"{self.python} is not there ({last}); pass python= with the interpreter's path on the hosts"
        return f"ssh failed: {last}"

    # ---------------------------------------------------------------- workers

    async def start(self, spec: WorkerSpec) -> SSHHandle:
        [host] = self._fit(1, spec.resources, self._ran_on.get(spec.replaces))
        self._ran_on[spec.worker_id] = host
        host.free_slots -= 1
        gpus, host.free_gpus = host.free_gpus[: spec.resources.nvidia_gpu], host.free_gpus[spec.resources.nvidia_gpu :]
        env = dict(spec.env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # zero GPUs means none visible, not all of them
        log_path = self.context.log_path(spec.worker_id)
        request: dict[str, object] = {"worker_id": spec.worker_id, "argv": list(spec.argv), "env": env}
        request |= {"cpu": spec.resources.cpu, "memory": spec.resources.memory, "collect": list(spec.collect)}
        request["silence_timeout"] = self.silence_timeout  # how long its relay waits for a connection
        ssh = functools.partial(self.ssh_argv, host.address)
        keepalive = keepalive_seconds(self.silence_timeout)
        remote = RemoteWorker(spec.worker_id, host.address, ssh, python=self.python, log_path=log_path,
                              silence=self.silence_timeout, keepalive=keepalive)  # fmt: skip
        try:
            await remote.start(request)
        except OSError as e:
            self._give_back(host, gpus)
            raise BackendError(f"could not start ssh for worker {spec.worker_id} on {host.address}: {e}") from e
        return SSHHandle(remote=remote, host=host, gpus=gpus, log_path=log_path, spec=spec)

    def _give_back(self, host: Host, gpus: list[str]) -> None:
        host.free_slots += 1
        host.free_gpus += [g for g in gpus if g not in host.free_gpus]
        host.free_gpus.sort(key=host.gpus.index)

    async def poll(self, handle: SSHHandle) -> int | None:
        return _exit_code(handle.remote.poll())

    async def wait(self, handle: SSHHandle) -> int:
        code = await handle.remote.finished()  # through connections that drop and come back
        self._release(handle)
        await self._bring_home(handle)
        return int(_exit_code(code) or 0)

    def _release(self, handle: SSHHandle) -> None:
        if not handle.released:
            handle.released = True
            self._give_back(handle.host, handle.gpus)

    async def stop(self, handle: SSHHandle, grace: float = 5.0) -> None:
        await handle.remote.stop(grace)  # the host ends the worker; an unreachable one is given up
        self._release(handle)
        await self._bring_home(handle)

    def output(self, handle: SSHHandle) -> str:
        return log_tail(handle.log_path)

    def exit_reason(self, handle: SSHHandle) -> str | None:
        return handle.remote.reason


def _exit_code(code: int | None) -> int | None:
    """The remote side exits with 128+N when signal N killed the agent; the contract says -N."""
    return signal_exit_code(code) if code is not None else None


def _route_address(host: str) -> str:
    """This machine's address on its route to `host` (no packet is sent)."""
    try:
        return route_address(host)
    except OSError as e:
        raise ConfigError(
            f"cannot find this machine's address towards {host} ({e}); pass controller_ip= (an address of "
            "this machine the hosts can reach)"
        ) from None
