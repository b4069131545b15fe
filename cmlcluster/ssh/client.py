"""The one ssh command line cmlcluster runs a command on another machine with: OpenSSH's own client.

Both the ssh backend (each worker's connection to its host) and the slurm backend (Slurm's commands on a
login node) build it here: BatchMode (no prompt a notebook could not answer), host keys pinned
(StrictHostKeyChecking=yes; a host seen for the first time is accepted only with trust_on_first_use, asked
for by name, and recorded in cmlcluster's own file, never ~/.ssh/known_hosts), keepalives sized to the
session's silence_timeout, the user's identity only where given (never copied anywhere), and the command
quoted word by word for the login shell there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..wire import DEFAULT_SILENCE_TIMEOUT
from ..workers import user_file
from .config import keepalive_options, ssh_path
from .keys import tofu_known_hosts

CONNECT_TIMEOUT = 10  # seconds for ssh to reach a host and log in


@dataclass
class SSHClient:
    user: str | None = None
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    trust_on_first_use: bool = False
    options: Sequence[str] = ()  # "Name=value", each given to ssh as -o
    silence_timeout: float = DEFAULT_SILENCE_TIMEOUT

    def argv(self, host: str, *command: str, connect_timeout: int = CONNECT_TIMEOUT) -> list[str]:
        """The ssh command line that runs `command` on `host` (options first: ssh keeps the first value)."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-p", str(self.port)]
        argv += ["-o", f"StrictHostKeyChecking={'accept-new' if self.trust_on_first_use else 'yes'}"]
        argv += keepalive_options(self.silence_timeout)
        argv += ["-o", f"ConnectTimeout={connect_timeout}"]
        if self.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={ssh_path(self.known_hosts)}"]
        elif self.trust_on_first_use:  # a new key goes into the first file: ours; the user's still pins its keys
            argv += ["-o", f"UserKnownHostsFile={ssh_path(tofu_known_hosts())} ~/.ssh/known_hosts"]
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            argv += ["-o", option]
        if self.user:
            argv += ["-l", self.user]
        # ssh hands the command to the login shell there: one quoted word each.
        return [*argv, host, "--", " ".join(shell_word(word) for word in command)]


def key_files(identity: str | None, known_hosts: str | None) -> tuple[str | None, str | None]:
    """The user's identity= and known_hosts= as absolute paths, each checked (ConfigError naming a bad one)."""
    identity, known_hosts = (
        user_file(path, name=name) if path is not None else None
        for name, path in (("identity", identity), ("known_hosts", known_hosts))
    )
    return identity, known_hosts


def shell_word(text: str) -> str:
    """One word for a POSIX shell, whatever it holds."""
    return "'" + text.replace("'", "'\"'\"'") + "'"
