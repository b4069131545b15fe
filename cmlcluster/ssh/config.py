"""Pure builders: known_hosts lines, ssh config text and sshd config text, and the checks of what a
worker's sshd says about itself. Nothing here runs anything.

Every value that lands in one of these files comes from somewhere else (a worker's answer, its
environment, a temp folder's name) and each file is read line by line: a newline, or a quote that
ends a word early, would add a line or a word of the sender's choosing. So values are checked
strictly and quoted where the file's parser takes quotes, never trusted to be well formed.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from .. import checks
from ..errors import ConfigError, WorkerError

MAX_WORKER_ADDRESSES = 256  # a worker's interface addresses in its sshd's answer: a few, a big host's dozens
KEEPALIVE_SECONDS = 5  # ssh asks a quiet host this often (or every silence_timeout, when shorter)
# The host key types an sshd may answer with, each with the number of SSH strings its blob holds
# (RFC 4253 6.6, RFC 5656 3.1, RFC 8709 4): the type again, then the key's parts.
HOST_KEY_PARTS = {
    "ssh-ed25519": 2,  # type, 32-byte key
    "ecdsa-sha2-nistp256": 3,  # type, curve name, point
    "ecdsa-sha2-nistp384": 3,
    "ecdsa-sha2-nistp521": 3,
    "ssh-rsa": 3,  # type, e, n
}
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
# A login name sshd's AllowUsers and ssh's User take as one name: no spaces, no patterns ('*', '?',
# '!', ','), no '@' (AllowUsers reads USER@HOST), no leading '-'; a trailing '$' as Samba's machine
# accounts have.
_LOGIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?")
# What ssh's config parser takes in a word unquoted: anything else is written quoted (ssh_path).
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_./+:@-]+")


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
    if '"' in path or not path.isprintable():
        raise ConfigError(
            f"{path!r}: ssh cannot be given a path with a double quote or a control character (a newline) in "
            "it; choose another"
        )
    return '"' + path.replace("%", "%%") + '"'


def _config_path(path: str) -> str:
    """A path as a word of an ssh config file: bare when it is plain, else quoted (ssh_path), so that
    a space in TMPDIR does not split it in two."""
    return path if _PLAIN_PATH.fullmatch(path) and "%" not in path else ssh_path(path)


def is_login_name(user: object) -> bool:
    """Whether `user` is a login name ssh's User and sshd's AllowUsers both take as that one name."""
    return isinstance(user, str) and _LOGIN.fullmatch(user) is not None


def public_key(key: object) -> tuple[str, str]:
    """(type, base64 blob) of an OpenSSH public key line "ssh-ed25519 AAAA... [comment]", checked
    strictly: a host key type sshd offers (HOST_KEY_PARTS), canonical base64 that decodes to a blob
    of exactly that type's parts whose own type is the one named, and a comment of printable
    characters alone. ValueError saying what is wrong otherwise (never a line break gets through)."""
    if not isinstance(key, str):
        raise ValueError(f"a public key is a string, not a {type(key).__name__}")
    if not key.isprintable():
        raise ValueError("it holds a line break or another control character")
    kind, _, rest = key.strip(" ").partition(" ")
    blob, _, _comment = rest.partition(" ")
    if kind not in HOST_KEY_PARTS:
        raise ValueError(f"type {kind[:40]!r} is not a host key type sshd offers ({', '.join(HOST_KEY_PARTS)})")
    if not _BASE64.fullmatch(blob):
        raise ValueError("its key is not base64")
    try:
        raw = base64.b64decode(blob, validate=True)
    except binascii.Error as e:
        raise ValueError(f"its key is not base64 ({e})") from None
    if base64.b64encode(raw).decode() != blob:
        raise ValueError("its key is not canonical base64")
    parts = _ssh_strings(raw)
    if parts is None or len(parts) != HOST_KEY_PARTS[kind]:
        raise ValueError(f"its key is not a {kind} key blob")
    if parts[0] != kind.encode():
        raise ValueError(f"its key blob says {parts[0][:40]!r}, not {kind!r}")
    if kind == "ssh-ed25519" and len(parts[1]) != 32:
        raise ValueError("its ed25519 key is not 32 bytes long")
    if kind.startswith("ecdsa-") and parts[1] != kind.rsplit("-", 1)[1].encode():
        raise ValueError(f"its key blob names curve {parts[1][:20]!r}, not the one {kind!r} says")
    return kind, blob


def _ssh_strings(raw: bytes) -> list[bytes] | None:
    """The SSH wire strings (uint32 length, bytes) that make up `raw` exactly; None if they do not."""
    parts, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            return None
        (length,) = struct.unpack(">I", raw[at : at + 4])
        at += 4
        if at + length > len(raw):
            return None
        parts.append(raw[at : at + length])
        at += length
    return parts


def known_hosts_text(host_keys: Mapping[str, str], port: int) -> str:
    """known_hosts lines pinning each host's key on its sshd port: "[10.0.0.2]:2222 ssh-ed25519 AAAA...".
    A key that is not one OpenSSH public key (public_key) is refused: one line per host, always."""
    lines = []
    for host, key in host_keys.items():
        if not checks.host(host):
            raise ConfigError(f"host {host!r}: give an IP address or host name (no leading '-', brackets or spaces)")
        try:
            kind, blob = public_key(key)
        except ValueError as e:
            raise ConfigError(f"host key of {host!r} is not an OpenSSH public key: {e}") from None
        lines.append(f"{host_pattern(host, port)} {kind} {blob}\n")
    return "".join(lines)


@dataclass(frozen=True)
class SshdAnswer:
    """What a worker's sshd (cmlcluster.ssh.sshd:start) said about itself, checked (sshd_answer)."""

    host_key: str  # "type base64", no comment
    user: str  # the login name it admits
    addresses: tuple[str, ...] = ()  # the worker's own interface addresses, as ipaddress writes them
    interface: str | None = None  # the name of its interface holding the address the session reaches it at


def sshd_answer(worker: str, answer: object) -> SshdAnswer:
    """A worker's answer to cmlcluster.ssh.sshd:start, checked before any of it reaches a file: a
    worker is not trusted to write the session's known_hosts or ssh config. WorkerError naming
    the worker and what is wrong with its answer (never the answer's text: it may be anything)."""

    def refuse(why: str) -> WorkerError:
        return WorkerError(
            f"worker {worker}: its sshd's answer is refused: {why}. Its host key cannot be pinned, so no "
            "rank runs there; is the worker's cmlcluster the session's own version?",
            worker,
        )

    # Where ranks start is not asked: the worker's sshd sets CMLCLUSTER_WORKDIR in their environment.
    fields = {"host_key", "user", "addresses", "interface"}
    if not isinstance(answer, Mapping) or set(answer) != fields:
        keys = sorted(map(str, answer)) if isinstance(answer, Mapping) else type(answer).__name__
        raise refuse(f"expected a dict of host_key, user, addresses and interface, got {keys}")
    try:
        kind, blob = public_key(answer["host_key"])
    except ValueError as e:
        raise refuse(f"host_key is not an OpenSSH public key: {e}") from None
    if not is_login_name(answer["user"]):
        raise refuse("user is not a login name (letters, digits, '_', '.', '-')")
    try:
        addresses = interface_addresses(answer["addresses"])
    except ValueError as e:
        raise refuse(f"addresses: {e}") from None
    interface = answer["interface"]
    if interface is not None and not checks.interface_name(interface):
        # horovodrun puts it unquoted in the shell command that starts each rank.
        raise refuse("interface is not an interface name (1 to 15 letters, digits, '_', '.', ':', '-')")
    return SshdAnswer(host_key=f"{kind} {blob}", user=answer["user"], addresses=addresses, interface=interface)


def interface_addresses(given: object) -> tuple[str, ...]:
    """A worker's interface addresses (sshd.start's "addresses"), checked: a list of at most
    MAX_WORKER_ADDRESSES IP addresses (no zone, no prefix), none loopback, unspecified or multicast,
    which no peer dials from elsewhere; each as ipaddress writes it, once. ValueError saying what is
    wrong (never the value: it may be anything)."""
    if not isinstance(given, list | tuple):
        raise ValueError(f"expected a list of IP addresses, got {type(given).__name__}")
    if len(given) > MAX_WORKER_ADDRESSES:
        raise ValueError(f"{len(given)} of them, more than {MAX_WORKER_ADDRESSES}")
    found: dict[str, None] = {}
    for i, text in enumerate(given):
        try:
            if not isinstance(text, str) or len(text) > 45:  # the longest: an IPv6 address ending in an IPv4 one
                raise ValueError
            address = ipaddress.ip_address(text)
            if getattr(address, "scope_id", None):  # fe80::1%eth0: the zone names the worker's interface, no peer's
                raise ValueError
        except ValueError:
            raise ValueError(f"item {i} is not an IP address") from None
        if address.is_loopback or address.is_unspecified or address.is_multicast:
            raise ValueError(f"item {i} is a loopback, unspecified or multicast address, no interface's own")
        found[str(address)] = None
    return tuple(found)


def ssh_config_text(logins: Mapping[str, str], port: int, identity_file: str, known_hosts: str) -> str:
    """An ssh config so that plain `ssh <host>` (and horovodrun, mpirun) log in as {host: user} with this key."""
    blocks = []
    for host, user in logins.items():
        if not checks.host(host):
            raise ConfigError(f"host {host!r}: give an IP address or host name (no leading '-', brackets or spaces)")
        if not is_login_name(user):
            raise ConfigError(f"user {user!r} for host {host!r}: give a login name")
        blocks.append(
            f"Host {host}\n"
            f"    Port {port}\n"
            f"    User {user}\n"
            f"    IdentityFile {_config_path(identity_file)}\n"
            f"    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {_config_path(known_hosts)}\n"
            f"    StrictHostKeyChecking yes\n"
            f"    PasswordAuthentication no\n"
            f"    BatchMode yes\n"
        )
    return "\n".join(blocks)


def _sshd_word(what: str, value: str) -> str:
    """`value` as one double-quoted word of sshd_config. sshd reads its config line by line and
    splits a line into words at spaces outside double quotes; OpenSSH 8.7 and later also read
    backslash escapes inside them, earlier ones do not (a quoted word ends at the next '"'). So a
    value with a line break, a NUL, a '"' or a '\\' cannot be carried the same way by every sshd:
    ConfigError naming `what`."""
    bad = next((c for c in value if c in '"\\' or not c.isprintable()), None)
    if bad is not None:
        raise ConfigError(
            f"{what}: sshd's config cannot carry a value holding {bad!r} (a line break, NUL, control character, "
            "double quote or backslash would change what sshd reads); use a value without it"
        )
    return f'"{value}"'


def sshd_config_text(folder: str, port: int, user: str, env: Mapping[str, str], listen: str | None = None) -> str:
    """The config of a worker's sshd (cmlcluster.ssh.sshd): its files in `folder`, key-only logins of
    `user` alone, on `listen` (the address peers use; every address when None), no forwarding of any
    kind, and `env` set in every login (SetEnv). Every value is checked to stay one word on its own
    line (_sshd_word): ConfigError naming the value otherwise, before sshd starts."""
    if not is_login_name(user):
        raise ConfigError(f"user {user!r}: sshd admits a login name, without spaces, '@' or patterns")
    if listen is not None and not checks.host(listen):
        raise ConfigError(f"listen={listen!r}: give the IP address peers reach this worker at")
    words = []
    for name, value in env.items():
        if not checks.env_name(name):
            raise ConfigError(
                f"SetEnv {name!r}: not a variable name; use letters, digits and '_', not starting with a digit"
            )
        words.append(_sshd_word(f"SetEnv {name}", f"{name}={value}"))
    where = f"sshd's folder {folder!r} (in the worker's TMPDIR)"
    return (
        f"Port {port}\n"
        + (f"ListenAddress {listen}\n" if listen is not None else "")
        + f"HostKey {_sshd_word(where, folder + '/host_key')}\n"
        # sshd expands %-tokens (%h, %u) in AuthorizedKeysFile alone: a '%' in its path is doubled.
        f"AuthorizedKeysFile {_sshd_word(where, folder.replace('%', '%%') + '/authorized_keys')}\n"
        f"PidFile {_sshd_word(where, folder + '/sshd.pid')}\n"
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
        "PermitUserEnvironment no\n" + (f"SetEnv {' '.join(words)}\n" if words else "") + "LogLevel ERROR\n"
    )
