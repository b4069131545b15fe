"""This session's SSH identity and the workers' pinned host keys.

A fresh ed25519 key per session (never the user's own keys). paramiko cannot
generate ed25519 keys, so they are made with `cryptography`, which paramiko is
built on, and loaded back with paramiko to check them.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from .config import known_hosts_text, ssh_config_text


def new_ed25519(comment: str = "") -> tuple[str, str]:
    """(private key in OpenSSH format, public key line)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, (public.decode() + (f" {comment}" if comment else ""))


@dataclass
class SessionSSH:
    """The files plain ssh, horovodrun and mpirun use for this session's workers; removed by close()."""

    folder: str
    identity_file: str
    public_key: str
    known_hosts: str
    config: str
    ssh_wrapper_dir: str

    @classmethod
    def create(cls, parent: str | None = None) -> SessionSSH:
        folder = tempfile.mkdtemp(prefix="cmlcluster-ssh-", dir=parent)
        private, public = new_ed25519(comment="cmlcluster-session")
        identity = os.path.join(folder, "id_ed25519")
        with open(os.open(identity, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(private)
        wrapper_dir = os.path.join(folder, "bin")
        os.mkdir(wrapper_dir)
        ssh = cls(
            folder=folder,
            identity_file=identity,
            public_key=public,
            known_hosts=os.path.join(folder, "known_hosts"),
            config=os.path.join(folder, "ssh_config"),
            ssh_wrapper_dir=wrapper_dir,
        )
        ssh._write_wrapper()
        return ssh

    def pin(self, host_keys: Mapping[str, str], port: int, users: Mapping[str, str]) -> None:
        """Record the hosts' keys ({host: public key line}) and an ssh config logging in as {host: user}.
        Both texts are built (and so checked: one line per host, one word per value) before either
        file is written: a bad key leaves the files as they were."""
        known = known_hosts_text(host_keys, port)
        config = ssh_config_text(users, port, self.identity_file, self.known_hosts)
        with open(self.known_hosts, "w") as f:
            f.write(known)
        with open(self.config, "w") as f:
            f.write(config)

    def _write_wrapper(self) -> None:
        # horovodrun runs `ssh -o StrictHostKeyChecking=no ...`, and options given on the command
        # line beat any config file. This ssh, first on horovodrun's PATH, turns that option
        # back to "yes", so the pinned known_hosts file really decides. Its paths are quoted: the
        # session's folder is in TMPDIR, which may hold a space.
        real_ssh = shutil.which("ssh") or "/usr/bin/ssh"
        path = os.path.join(self.ssh_wrapper_dir, "ssh")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o700), "w") as f:
            f.write(
                "#!/bin/sh\n"
                "# cmlcluster: host keys of this session's workers are pinned; never skip the check.\n"
                'for a do shift; [ "$a" = StrictHostKeyChecking=no ] && a=StrictHostKeyChecking=yes; '
                'set -- "$@" "$a"; done\n'
                f'exec {shlex.quote(real_ssh)} -F {shlex.quote(self.config)} "$@"\n'
            )

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def tofu_known_hosts() -> str:
    """cmlcluster's own known_hosts file, where host keys accepted on first use are recorded (made
    empty, 0600, in a 0700 folder, on first use): $XDG_CONFIG_HOME/cmlcluster/known_hosts, else
    ~/.config/cmlcluster/known_hosts. Never the user's ~/.ssh/known_hosts, which other tools trust."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    folder = os.path.join(base, "cmlcluster")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "known_hosts")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    return path
