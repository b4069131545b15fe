"""Pure builders: hosts and slots to horovodrun / mpirun argv lists and hostfiles (ssh texts: ssh/config.py).

Every command is an argv list, never a shell string, and nothing here runs anything.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import checks
from ..errors import ConfigError

SSH_PORT = 2222  # sshd in every worker, as in CML and Kubeflow's MPI operator
# The address horovodrun's rendezvous listens on and tells the ranks, given by the session to
# cmlcluster.horovod.driver (taken out of the environment before horovodrun copies it): when
# cmlcluster names the hosts' interface itself, this machine need not have one of that name.
DRIVER_ADDRESS_ENV = "CMLCLUSTER_HOROVOD_DRIVER_ADDRESS"

Hosts = Sequence[tuple[str, int]]  # (address, slots)


def check_hosts(hosts: Hosts) -> list[tuple[str, int]]:
    if not hosts:
        raise ConfigError("hosts=[]: give at least one (address, slots) pair")
    seen = set()
    for host, slots in hosts:
        if not checks.host(host):  # a leading '-' would be an option of ssh or mpirun
            raise ConfigError(
                f"host {host!r}: give an IP address or host name (no leading '-', brackets, spaces or commas)"
            )
        if not checks.whole(slots, 1):
            raise ConfigError(f"host {host!r} has slots={slots!r}: each host needs 1 or more slots")
        if host in seen:
            raise ConfigError(f"host {host!r} is listed twice; give it once with all its slots")
        seen.add(host)
    return list(hosts)


def total_slots(hosts: Hosts) -> int:
    return sum(slots for _, slots in check_hosts(hosts))


def hosts_arg(hosts: Hosts) -> str:
    """horovodrun's -H value: "10.0.0.2:2,10.0.0.3:2"."""
    return ",".join(f"{host}:{slots}" for host, slots in check_hosts(hosts))


def common_interface(reported: Mapping[str, str | None]) -> str:
    """The one interface name {host: its interface toward the session, as its worker reported it} agree
    on, for horovodrun's --network-interfaces: given it, horovodrun never probes the hosts' interfaces
    (a task service on each host, started with a command line that holds the run's service key).

    Horovod's Gloo takes one interface name for every rank (HOROVOD_GLOO_IFACE), so hosts that name
    theirs differently, or a host whose address is on no interface of its own (translated on the way),
    cannot be served from the reports: ConfigError naming each host's interface and the fix."""
    if not reported:
        raise ConfigError("no hosts reported an interface; give at least one host")
    names = set(reported.values())
    if len(names) == 1 and None not in names:
        [name] = names
        assert name is not None
        return name
    listed = ", ".join(f"{host}: {name or 'none holds its address'}" for host, name in sorted(reported.items()))
    raise ConfigError(
        f"the hosts' interfaces toward the session differ ({listed}); Horovod's Gloo needs one interface name on "
        "every host. Name one every host has, and give it: SSHBackend(..., network_interfaces=['ens5'])"
    )


def _check_np(np: int, hosts: Hosts) -> None:
    slots = total_slots(hosts)
    if not checks.whole(np, 1, slots):
        raise ConfigError(f"np={np!r}: the hosts have {slots} slots in all; ask for 1 to {slots} processes")


def check_port(port: int) -> None:
    if not checks.port(port):
        raise ConfigError(f"ssh_port={port!r}: give the TCP port sshd listens on in the workers (2222)")


def check_start_timeout(seconds: int) -> None:
    if not checks.whole(seconds, 1):
        raise ConfigError(f"start_timeout={seconds!r}: give whole seconds, 1 or more")


# horovod blacklists a host with a failed rank, for good unless given a cooldown (elastic/discovery.py):
# a replacement at the lost one's address, or a pseudo-host on this machine, then comes back in seconds.
BLACKLIST_COOLDOWN = (1, 10)
# After a loss the survivors wait this long in Gloo's rendezvous for the new ranks, which start Python and
# TensorFlow meanwhile (Horovod's 30 s default aborts them on a loaded machine).
ELASTIC_GLOO_TIMEOUT = 120


@dataclass(frozen=True)
class ElasticArgs:
    """horovodrun's elastic mode: hosts from a discovery script, np kept between min_np and max_np."""

    discovery_script: str  # run by horovod through a shell: its path is quoted once, here
    min_np: int
    max_np: int
    reset_limit: int | None = None  # how many times horovod may restart the ranks; None: no limit of its own
    cooldown: tuple[int, int] = BLACKLIST_COOLDOWN
    gloo_timeout: int = ELASTIC_GLOO_TIMEOUT

    def argv(self) -> list[str]:
        argv = ["--host-discovery-script", shlex.quote(self.discovery_script)]
        argv += ["--min-np", str(self.min_np), "--max-np", str(self.max_np)]
        argv += ["--blacklist-cooldown-range", *map(str, self.cooldown)]
        argv += ["--gloo-timeout-seconds", str(self.gloo_timeout)]
        if self.reset_limit is not None:
            argv += ["--reset-limit", str(self.reset_limit)]
        return argv


def discovery_text(hosts: Hosts) -> str:
    """What a host-discovery script prints: one "address:slots" line per host."""
    return "".join(f"{host}:{slots}\n" for host, slots in check_hosts(hosts)) if hosts else ""


def local_pseudo_hosts(np: int) -> list[tuple[str, int]]:
    """np ranks on this machine as two host names: horovod blacklists the whole host of a failed rank
    and stops when every host is blacklisted, so one "localhost" could never restart a rank (horovod's
    own elastic tests use these two names the same way)."""
    if np < 2:
        raise ConfigError(f"np={np}: an elastic run needs 2 or more processes, one to carry the state over")
    return [("localhost", (np + 1) // 2), ("127.0.0.1", np // 2)]


def elastic_min_np(np: int, hosts: Hosts) -> int:
    """The fewest processes an elastic run trains on: all but one host's. horovod starts ranks on a host
    again only once it has left the run's assignments, which it does only when the others go on without it."""
    return max(1, np - max(slots for _, slots in check_hosts(hosts)))


def horovodrun_argv(
    np: int,
    hosts: Hosts,
    command: Sequence[str],
    *,
    ssh_port: int | None = SSH_PORT,
    identity_file: str | None = None,
    start_timeout: int | None = None,
    network_interfaces: Sequence[str] = (),
    horovodrun: Sequence[str] = ("horovodrun",),
    extra: Sequence[str] = (),
    elastic: ElasticArgs | None = None,
) -> list[str]:
    """horovodrun -np N -H ip:slots,... [-p 2222] [-i key] [--start-timeout s] [--network-interfaces ...] cmd...

    elastic: the hosts come from its discovery script instead of -H (`hosts` are the first ones)."""
    _check_np(np, hosts)
    if not command:
        raise ConfigError("command=[]: give the training command, e.g. [sys.executable, 'train.py']")
    argv = [*horovodrun, "-np", str(np)]
    argv += elastic.argv() if elastic is not None else ["-H", hosts_arg(hosts)]
    if ssh_port is not None:
        check_port(ssh_port)
        argv += ["-p", str(ssh_port)]
    if identity_file:
        argv += ["-i", identity_file]
    if start_timeout is not None:
        check_start_timeout(start_timeout)
        argv += ["--start-timeout", str(start_timeout)]
    if network_interfaces:
        argv += ["--network-interfaces", ",".join(network_interfaces)]
    return [*argv, *extra, *command]


def mpirun_argv(
    np: int,
    hosts: Hosts,
    command: Sequence[str],
    *,
    ssh_port: int = SSH_PORT,
    identity_file: str | None = None,
    known_hosts: str | None = None,
    network_interfaces: Sequence[str] = (),
    env: Sequence[str] = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH"),
    mpirun: str = "mpirun",
) -> list[str]:
    """The OpenMPI equivalent, for MPI builds of Horovod: ssh on the workers' port, TCP on their NICs."""
    _check_np(np, hosts)
    check_port(ssh_port)
    ssh_args = ["-p", str(ssh_port)]
    if identity_file:
        ssh_args += ["-i", identity_file]
    if known_hosts:
        ssh_args += ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}"]
    argv = [mpirun, "-np", str(np), "-H", hosts_arg(hosts), "-bind-to", "none", "-map-by", "slot"]
    argv += ["-mca", "plm_rsh_args", shlex.join(ssh_args)]
    if network_interfaces:
        nics = ",".join(network_interfaces)
        argv += ["-mca", "btl_tcp_if_include", nics, "-mca", "oob_tcp_if_include", nics]
    argv += ["-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    for name in env:
        argv += ["-x", name]
    return [*argv, *command]


def hostfile_text(hosts: Hosts) -> str:
    """An OpenMPI hostfile (machinefile): one "host slots=N" line per host, as in the Rescale article."""
    return "".join(f"{host} slots={slots}\n" for host, slots in check_hosts(hosts))
