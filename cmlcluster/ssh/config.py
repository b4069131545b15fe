"""Pure builders: known_hosts lines and ssh config text. Nothing here runs anything."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from ..errors import ConfigError


def host_pattern(host: str, port: int) -> str:
    """How known_hosts names a host on a port: "10.0.0.2" on 22, "[10.0.0.2]:2222" elsewhere."""
    return f"[{host}]:{port}" if port != 22 else host


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
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not host or any(c.isspace() for c in host):
                raise ConfigError(f"host {host!r}: give an IP address or host name") from None
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
