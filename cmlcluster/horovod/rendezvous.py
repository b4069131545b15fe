"""Who may talk to horovodrun's rendezvous: a per-run key for what it unpickles, and the job's hosts only.

horovodrun's rendezvous is an HTTP key-value store without authentication. In an elastic run, a
``PUT /worker_addresses/<host>:<local_rank>`` is passed to cloudpickle.loads before anything is
checked (horovod.runner.elastic.rendezvous), and its value names a rank's notification service
with the key that service trusts. So, for each elastic run:

- the session makes a key (32 random bytes) that reaches the driver in a 0600 file
  (KEY_FILE_ENV names it) and the ranks in their environment, from their own 0600 files
  (cmlcluster.horovod.rank), never on a command line: horovodrun writes its environment on each
  rank's;
- each rank signs its worker_addresses PUT (an HMAC-SHA256 of the method, path and body, in
  SIGNATURE_HEADER); the driver checks it before anything is decoded, answers 403 otherwise, and
  answers every other request on that scope 403 (nothing legitimate reads it back);
- the driver admits a connection only from the job's hosts' addresses (every address each host's
  worker reported of its own interfaces, in a file the session rewrites as hosts come and go, which
  HOSTS_FILE_ENV names: a rank dials from its address on the interface horovodrun picked, an
  InfiniBand or second NIC, not only from the one its -H name resolves to; a worker is trusted this
  far already, its ranks hold the key, and loopback or this machine's addresses it may name are
  still checked by uid) and, from this machine
  (loopback or one of its own addresses), only from a socket of the session's own user, which the
  kernel names (cmlcluster.socket_owners). A refused connection is closed unread. Gloo's
  own requests (C++, plain GET/PUT/DELETE that cannot carry a header) are covered by this alone;
  they store bytes and never decode them.

The parts (signatures, whose socket a peer's is, the admission rule) are here; driver.py installs
them in horovodrun, rank.py in each rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..socket_owners import Endpoint, IPAddress, peer_owner, unmapped

KEY_ENV = "CMLCLUSTER_RENDEZVOUS_KEY"  # a rank's: the run's key, hex (from its 0600 env file)
KEY_FILE_ENV = "CMLCLUSTER_RENDEZVOUS_KEY_FILE"  # the driver's: a 0600 file holding the key, hex
HOSTS_FILE_ENV = "CMLCLUSTER_RENDEZVOUS_HOSTS_FILE"  # the driver's: each job host's own addresses (JSON)
SIGNATURE_HEADER = "X-Cmlcluster-Signature"
SIGNED_SCOPE = "worker_addresses"  # horovod.runner.elastic.rendezvous.PUT_WORKER_ADDRESSES
KEY_BYTES = 32
MAX_SIGNED_BODY = 1 << 20  # a rank's addresses and its service's key: a few hundred bytes


# -- the key and the signature -----------------------------------------------------------------


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def signature(key: bytes, method: str, path: str, body: bytes) -> str:
    """HMAC-SHA256 over the request's method, path (/<scope>/<key>) and body, hex."""
    message = method.upper().encode() + b" " + path.encode("utf-8", "surrogateescape") + b"\n" + body
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(key: bytes, method: str, path: str, body: bytes, given: str | None) -> bool:
    """Whether `given` is the request's signature (in constant time)."""
    if not given:
        return False
    return hmac.compare_digest(signature(key, method, path, body).encode(), given.strip().encode("ascii", "replace"))


def parse_key(text: str) -> bytes:
    """The key from its hex form; ValueError when it is not KEY_BYTES bytes of hex."""
    key = bytes.fromhex(text.strip())
    if len(key) != KEY_BYTES:
        raise ValueError(f"a rendezvous key is {KEY_BYTES} bytes, this one {len(key)}")
    return key


@dataclass(frozen=True)
class RunKey:
    """One run's key and its 0600 file; empty (no key) for a static run, whose rendezvous unpickles nothing."""

    key: bytes | None = None
    path: str | None = None

    @property
    def rank_env(self) -> dict[str, str]:
        """For the ranks' 0600 env files."""
        return {KEY_ENV: self.key.hex()} if self.key else {}

    @property
    def driver_env(self) -> dict[str, str]:
        """For the driver's environment: the file's path, which the driver takes out before horovodrun runs."""
        return {KEY_FILE_ENV: self.path} if self.path else {}


@contextlib.contextmanager
def run_key(folder: str | None, elastic: bool) -> Iterator[RunKey]:
    """A new key in a 0600 file of `folder` for an elastic run (RunKey() for a static one); the file goes at the end."""
    if not elastic:
        yield RunKey()
        return
    key = new_key()
    fd, path = tempfile.mkstemp(prefix="rendezvous-key-", dir=folder)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.hex())
        yield RunKey(key, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def read_key_file(path: str) -> bytes:
    with open(path) as f:
        return parse_key(f.read())


def admits(
    peer: Endpoint,
    server: Endpoint,
    *,
    uid: int,
    own_addresses: frozenset[IPAddress],
    host_addresses: frozenset[IPAddress],
    owner: Callable[[Endpoint, Endpoint], int | None] = peer_owner,
) -> bool:
    """Whether the rendezvous serves a connection from `peer` to its `server` address.

    From this machine (a loopback address or one of `own_addresses`): only from a socket of `uid`
    (`owner` says whose the peer's socket is). From elsewhere: only from one of the job's hosts
    (`host_addresses`).
    """
    address = unmapped(peer[0])
    if address.is_loopback or address in own_addresses:
        return owner((address, peer[1]), server) == uid
    return address in host_addresses


# -- the job's hosts' own addresses: a file the session rewrites, the driver reads ------------------


def host_addresses_text(hosts: Mapping[str, Iterable[str]]) -> str:
    """{host name as horovodrun's -H and discovery give it: its addresses} as the file holds it."""
    return json.dumps({name: sorted(set(addresses)) for name, addresses in hosts.items()}, sort_keys=True)


def parse_host_addresses(text: str) -> dict[str, frozenset[IPAddress]]:
    """The file's {host name: addresses}; ValueError when it is not a JSON object of names to lists of IP addresses."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    found = {}
    for name, addresses in data.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"the addresses of {name!r} are not a list of strings")
        found[name] = frozenset(unmapped(ipaddress.ip_address(a)) for a in addresses)
    return found


def write_host_addresses(path: str, hosts: Mapping[str, Iterable[str]]) -> None:
    """Replace `path` (0600) with `hosts`, whole and at once: a reader sees the old list or the new one."""
    fd, temporary = tempfile.mkstemp(prefix=".host-addresses-", dir=os.path.dirname(path) or None)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(host_addresses_text(hosts))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def read_host_addresses(path: str) -> dict[str, frozenset[IPAddress]]:
    with open(path) as f:
        return parse_host_addresses(f.read())


# -- the driver's side -------------------------------------------------------------------------


def resolve(names: Iterable[str]) -> frozenset[IPAddress]:
    """Every address each name resolves to (a name that does not resolve adds none)."""
    found: set[IPAddress] = set()
    for name in names:
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            continue
        for info in infos:
            with contextlib.suppress(ValueError):
                found.add(unmapped(ipaddress.ip_address(str(info[4][0]).split("%")[0])))
    return frozenset(found)


def own_addresses() -> frozenset[IPAddress]:
    """This machine's interface addresses."""
    import psutil

    found: set[IPAddress] = set()
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    found.add(unmapped(ipaddress.ip_address(a.address.split("%")[0])))
    return frozenset(found)


@dataclass
class Guard:
    """The rendezvous' admission and, with a key, its signed scope; install() puts both on a server.

    hosts_file: the session's file of each job host's own addresses (HOSTS_FILE_ENV; None where
    ranks run on this machine), read again at each set_hosts: a replacement host's are in it
    before horovod's discovery lists the host (ssh_cluster.SSHCluster writes it first)."""

    key: bytes | None
    uid: int = field(default_factory=os.getuid)
    own: frozenset[IPAddress] = field(default_factory=own_addresses)
    hosts_file: str | None = None
    hosts: frozenset[IPAddress] = frozenset()  # replaced whole (by set_hosts) as the job's hosts change
    _names: dict[str, frozenset[IPAddress]] = field(default_factory=dict)  # each name, resolved once
    _reported: dict[str, frozenset[IPAddress]] = field(default_factory=dict)  # hosts_file's, as last read
    _said: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_hosts(self, names: Iterable[str]) -> None:
        """The job's hosts now (horovodrun's -H, or what its discovery script printed last): the addresses
        each name resolves to, and those its worker reported (hosts_file)."""
        names = set(names)
        reported = self._read_hosts_file()
        with self._lock:
            if reported is not None:
                self._reported = reported
            for name in names - set(self._names):
                self._names[name] = resolve([name])
            self.hosts = frozenset().union(*(self._names[n] | self._reported.get(n, frozenset()) for n in names))

    def _read_hosts_file(self) -> dict[str, frozenset[IPAddress]] | None:
        """hosts_file's hosts; None (said once) when it cannot be read: the last ones read stay."""
        if self.hosts_file is None:
            return None
        try:
            return read_host_addresses(self.hosts_file)
        except (OSError, ValueError) as e:
            self._say(
                "hosts_file",
                f"cmlcluster: the job's hosts' addresses cannot be read from {self.hosts_file} ({e}); the Horovod "
                "rendezvous admits a host by those it last read, or else by those its name resolves to",
            )
            return None

    def verify_request(self, request: socket.socket, client_address: Any) -> bool:
        """socketserver's hook, called before a byte of the request is read: False closes the connection."""
        try:
            peer = (ipaddress.ip_address(str(client_address[0]).split("%")[0]), int(client_address[1]))
            bound = request.getsockname()
            server = (ipaddress.ip_address(str(bound[0]).split("%")[0]), int(bound[1]))
            ok = admits(peer, server, uid=self.uid, own_addresses=self.own, host_addresses=self.hosts)
        except (OSError, ValueError, IndexError, TypeError):
            ok = False
        if not ok:
            self._refused(str(client_address[0]))
        return ok

    def _refused(self, address: str) -> None:
        self._say(
            address,
            f"cmlcluster: the Horovod rendezvous refused a connection from {address}: neither an address of one of "
            "the job's hosts nor a process of this session's user on this machine",
        )

    def _say(self, what: str, message: str) -> None:
        """`message` on stderr, once for `what`, and for 20 things at most."""
        with self._lock:
            if what in self._said or len(self._said) >= 20:
                return
            self._said.add(what)
        print(message, file=sys.stderr, flush=True)

    def install(self, server: Any) -> None:
        """On a socketserver server (horovod's RendezvousHTTPServer) before it serves."""
        server.verify_request = self.verify_request
        if self.key is not None:
            server.RequestHandlerClass = signed_handler(server.RequestHandlerClass, self.key)


def _scope(path: str) -> str | None:
    parts = path.split("/")
    return parts[1] if len(parts) > 1 else None


def signed_handler(handler: type, key: bytes) -> type:
    """`handler` (horovod's rendezvous handler), with every request on SIGNED_SCOPE refused unless it is a
    PUT signed with `key`: its body is read, checked, and only then handed to the handler's _put_value."""

    class SignedRendezvousHandler(handler):
        def do_PUT(self) -> None:
            if _scope(self.path) != SIGNED_SCOPE:
                return super().do_PUT()
            parts = self.path.split("/")
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                length = -1
            if len(parts) != 3 or not 0 <= length <= MAX_SIGNED_BODY:
                return self.send_status_code(403)
            try:
                body = self.rfile.read(length)
            except OSError:  # a timeout: the handler's own (horovod's SINGLE_REQUEST_TIMEOUT)
                return None
            if len(body) != length or not verify(key, "PUT", self.path, body, self.headers.get(SIGNATURE_HEADER)):
                return self.send_status_code(403)
            self._put_value(parts[1], parts[2], body)  # checked: now horovod may decode it
            return self.send_status_code(200)

        def do_GET(self) -> None:
            if _scope(self.path) == SIGNED_SCOPE:  # it holds each rank's service key: nothing reads it back
                return self.send_status_code(403)
            return super().do_GET()

        def do_DELETE(self) -> None:
            if _scope(self.path) == SIGNED_SCOPE:
                return self.send_status_code(403)
            return super().do_DELETE()

    return SignedRendezvousHandler


# -- the rank's side ---------------------------------------------------------------------------


def signed_put(key: bytes, dumps: Callable[[Any], bytes]) -> Callable[[str, int, str, str, Any], None]:
    """horovod's put_data_into_kvstore(addr, port, scope, key, value), signing the request with `key`;
    `dumps` encodes the value as horovod's does (codec.dumps_base64)."""
    from urllib.error import HTTPError, URLError
    from urllib.request import Request, urlopen

    def put_data_into_kvstore(addr: str, port: int, scope: str, name: str, value: Any) -> None:
        path = f"/{scope}/{name}"
        body = dumps(value)
        request = Request(
            f"http://{addr}:{port}{path}",
            data=body,
            method="PUT",
            headers={SIGNATURE_HEADER: signature(key, "PUT", path, body)},
        )
        try:
            with urlopen(request, timeout=60):  # noqa: S310 - http to the address horovodrun gave this rank
                pass
        except (HTTPError, URLError) as e:
            raise RuntimeError("Put data input KVStore server failed.", e) from e  # horovod's words

    return put_data_into_kvstore


def rank_checks() -> list[tuple[str, Callable[[], bool]]]:
    """The private names of horovod a rank's signing reads (probes.Check)."""
    from horovod.runner.common.util import codec
    from horovod.runner.elastic import rendezvous, worker

    return [
        (
            "horovod.runner.elastic.worker.put_data_into_kvstore",
            lambda: callable(getattr(worker, "put_data_into_kvstore", None)),
        ),
        ("horovod.runner.common.util.codec.dumps_base64", lambda: callable(codec.dumps_base64)),
        (
            f"horovod.runner.elastic.rendezvous.PUT_WORKER_ADDRESSES == {SIGNED_SCOPE!r}",
            lambda: rendezvous.PUT_WORKER_ADDRESSES == SIGNED_SCOPE,
        ),
    ]


def require_horovod(checks: list[tuple[str, Callable[[], bool]]], used_to: str) -> None:
    """RuntimeError naming what of `checks` this horovod lacks, which cmlcluster uses `used_to` (words)."""
    from .. import probes

    missing = probes.missing(checks)
    if missing:
        import horovod

        raise RuntimeError(
            f"Horovod {horovod.__version__} no longer has {', '.join(missing)}, which cmlcluster uses {used_to}; "
            "use a Horovod cmlcluster supports (0.28)"
        )


def sign_worker_registration(key: bytes) -> None:
    """Make this rank's horovod sign the PUT with which hvd.elastic.run registers its notification service."""
    require_horovod(rank_checks(), "to sign this rank's registration with the elastic rendezvous")
    from horovod.runner.common.util import codec
    from horovod.runner.elastic import worker

    worker.put_data_into_kvstore = signed_put(key, lambda value: codec.dumps_base64(value, to_ascii=False))
