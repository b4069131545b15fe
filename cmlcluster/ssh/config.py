"""Pure builders: known_hosts lines, ssh config text and sshd config text. Nothing here runs anything."""

from __future__ import annotations

import math
from collections.abc import Mapping

from .. import checks
from ..errors import ConfigError

KEEPALIVE_SECONDS = 5  # ssh asks a quiet host this often (or every silence_timeout, when shorter)


def host_pattern(host: str, port: int) -> str:
    """How known_hosts names a host on a port: "10.0.0.2" on 22, "[10.0.0.2]:2222" elsewhere."""
    return f"[{host}]:{port}" if port != 22 else host


def _keepalives(silence_timeout: float) -> tuple[int, int]:
    interval = max(1, min(KEEPALIVE_SECONDS, math.floor(silence_timeout / 4)))
    return interval, max(1, math.ceil(silence_timeout / 2 / interval) - 1)


def keepalive_options(silence_timeout: float) -> list[str]:
    """ssh's keepalives for a session's silence_timeout (seconds). ssh asks a quiet host every
    `interval` s and gives up at the first ask after `misses` went unanswered (OpenSSH): after
    keepalive_seconds(), about half of silence_timeout. A worker does not end with its connection
    (its relay keeps it: backends/ssh_relay.py), and the session connects again until the host has
    been silent for the whole silence_timeout; giving a dead connection up early leaves that time
    to a new one (a NAT or a firewall that forgot the old one lets a new one through)."""
    interval, misses = _keepalives(silence_timeout)
    return ["-o", f"ServerAliveInterval={interval}", "-o", f"ServerAliveCountMax={misses}"]


def keepalive_seconds(silence_timeout: float) -> float:
    """How long a connection has been silent when ssh gives up on it: interval * (misses + 1)."""
    interval, misses = _keepalives(silence_timeout)
    return float(interval * (misses + 1))


def ssh_path(path: str) -> str:
    """A file's path as an ssh option's value: quoted (it may hold spaces), '%' doubled (ssh expands
    %-tokens in paths such as UserKnownHostsFile)."""
    if '"' in path:
        raise ConfigError(f"{path!r}: ssh cannot be given a path with a double quote in it; choose another")
    return '"' + path.replace("%", "%%") + '"'


def known_hosts_text(host_keys: Mapping[str, str], port: int) -> str:
    """known_hosts lines pinning each host's key on its sshd port: "[10.0.0.2]:2222 ssh-ed25519 AAAA..."."""
    lines = []
    for host, key in host_keys.items():
        kind, _, rest = key.strip().partition(" ")
        blob = rest.split(" ")[0]
        if not kind.startswith("ssh-") or not blob:
            raise ConfigError(f"host key of {host!r} is not an OpenSSH public key: {key!r}")
        lines.append(f"{host_pattern(host, port)} {kind} {blob}\n")
    return "".join(lines)


def ssh_config_text(logins: Mapping[str, str], port: int, identity_file: str, known_hosts: str) -> str:
    """An ssh config so that plain `ssh <host>` (and horovodrun, mpirun) log in as {host: user} with this key."""
    blocks = []
    for host, user in logins.items():
        if not checks.host(host):
            raise ConfigError(f"host {host!r}: give an IP address or host name (no leading '-', brackets or spaces)")
        if not user or any(c.isspace() for c in user):
            raise ConfigError(f"user {user!r} for host {host!r}: give a login name")
        blocks.append(
            f"Host {host}\n"
            f"    Port {port}\n"
            f"    User {user}\n"
            f"    IdentityFile {identity_file}\n"
            f"    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known_hosts}\n"
            f"    StrictHostKeyChecking yes\n"
            f"    PasswordAuthentication no\n"
            f"    BatchMode yes\n"
        )
    return "\n".join(blocks)


def sshd_config_text(folder: str, port: int, user: str, env: Mapping[str, str], listen: str | None = None) -> str:
    """The config of a worker's sshd (cmlcluster.ssh.sshd): its files in `folder`, key-only logins of
    `user` alone, on `listen` (the address peers use; every address when None), no forwarding of any
    kind, and `env` set in every login (SetEnv)."""
    if not user or any(c.isspace() or c in ",*?!" for c in user):
        raise ConfigError(f"user {user!r}: sshd admits a login name, without spaces or patterns")
    if listen is not None and not checks.host(listen):
        raise ConfigError(f"listen={listen!r}: give the IP address peers reach this worker at")
    words = " ".join(f'"{name}={value}"' for name, value in env.items())
    return (
        f"Port {port}\n" + (f"ListenAddress {listen}\n" if listen is not None else "") + f"HostKey {folder}/host_key\n"
        f"AuthorizedKeysFile {folder}/authorized_keys\n"
        f"PidFile {folder}/sshd.pid\n"
        f"AllowUsers {user}\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\n"
        "PermitEmptyPasswords no\n"
        "UsePAM no\n"
        "StrictModes no\n"  # the folder is the agent's own, mode 0700
        # Ranks need a command and its output, nothing more: no tunnels into or out of the worker.
        "DisableForwarding yes\n"
        "AllowTcpForwarding no\n"
        "AllowStreamLocalForwarding no\n"
        "GatewayPorts no\n"
        "PermitTunnel no\n"
        "X11Forwarding no\n"
        "AllowAgentForwarding no\n"
        "PermitUserEnvironment no\n" + (f"SetEnv {words}\n" if words else "") + "LogLevel ERROR\n"
    )
