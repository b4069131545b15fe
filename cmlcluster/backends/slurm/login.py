"""Slurm on a login node reached over SSH (SlurmBackend(login=...)): its options, checked before anything starts,
and the ssh client every Slurm command runs through there (ssh/client.py: the host key pinned, BatchMode).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ... import checks
from ...errors import ConfigError
from ...ssh.client import SSHClient, key_files

LOGIN = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9][A-Za-z0-9_.-]*")  # [user@]host, one word each


def login_client(
    login: str,
    port: int,
    identity: str | None,
    known_hosts: str | None,
    trust_on_first_use: bool,
    ssh_options: Sequence[str],
) -> tuple[str, SSHClient | None]:
    """The login node's host and how ssh reaches it (as whom), checked; ("", None) where Slurm is here."""
    given = {"identity": identity, "known_hosts": known_hosts, "ssh_options": ssh_options or None}
    if not login:
        named = [name for name, value in given.items() if value is not None] + ["login_port"] * (port != 22)
        if named or trust_on_first_use:
            raise ConfigError(f"{', '.join(named or ['trust_on_first_use'])}: these are for login=; give login='host'")
        return "", None
    if not isinstance(login, str) or not LOGIN.fullmatch(login):
        raise ConfigError(f"login={login!r}: give the login node as 'host' or 'user@host'")
    if not checks.port(port):
        raise ConfigError(f"login_port={port!r}: give the TCP port sshd listens on, on the login node (22)")
    if isinstance(ssh_options, str) or not all(isinstance(o, str) and "=" in o for o in ssh_options):
        raise ConfigError(f"ssh_options={ssh_options!r}: give a list of ssh options, each 'Name=value'")
    user, _, host = login.rpartition("@")  # ssh is told the user with -l
    identity, known_hosts = key_files(identity, known_hosts)
    client = SSHClient(user or None, port, identity, known_hosts, bool(trust_on_first_use), tuple(ssh_options))
    return host, client
