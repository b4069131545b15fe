"""Whose a TCP socket on this machine is: the uid the kernel names for it, asked of its socket
diagnostics (NETLINK_SOCK_DIAG, as `ss` asks them) for the one socket, else read from /proc/net/tcp
and tcp6 (as identd reads them).

Two questions are asked of it: whose is the other end of a connection a server accepted (the Horovod
rendezvous admits a process of the session's user only, horovod/rendezvous.py), and whose is the
listener a connection to 127.0.0.1:<port> would reach (a worker's app forwarder relays to its own
user's app only, apps/forward.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_LISTEN = 10  # the kernel's TCP_LISTEN state

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Endpoint = tuple[IPAddress, int]


# -- /proc/net/tcp ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp or /proc/net/tcp6."""

    local: Endpoint
    remote: Endpoint
    state: int
    uid: int
    inode: int


def unmapped(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it stands for; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _endpoint(text: str) -> Endpoint:
    """'0100007F:1F90' (the kernel's words in host byte order, then the port) -> (127.0.0.1, 8080)."""
    address_hex, port_hex = text.split(":")
    raw = bytes.fromhex(address_hex)
    words = struct.unpack(f">{len(raw) // 4}I", raw)  # each word as printed: a 32-bit number
    packed = struct.pack(f"={len(words)}I", *words)  # back into memory order
    return unmapped(ipaddress.ip_address(packed)), int(port_hex, 16)


def parse_tcp_table(text: str, local_port: int | None = None) -> list[TcpSocket]:
    """The rows of a /proc/net/tcp or /proc/net/tcp6 text (its header and any malformed line skipped);
    with `local_port`, only those of sockets on that port, found before any row is parsed (a busy
    machine has thousands, and the rendezvous looks one up at each connection)."""
    rows = []
    port_suffix = None if local_port is None else f":{local_port:04X}"
    for line in text.splitlines()[1:]:
        fields = line.split()
        if port_suffix is not None and not (len(fields) > 1 and fields[1].endswith(port_suffix)):
            continue
        try:
            rows.append(
                TcpSocket(
                    local=_endpoint(fields[1]),
                    remote=_endpoint(fields[2]),
                    state=int(fields[3], 16),
                    uid=int(fields[7]),
                    inode=int(fields[9]),
                )
            )
        except (IndexError, ValueError):
            continue
    return rows


def read_tcp_tables(paths: Iterable[str] = TCP_TABLES, local_port: int | None = None) -> list[TcpSocket]:
    rows = []
    for path in paths:
        with contextlib.suppress(OSError):
            with open(path) as f:
                rows.extend(parse_tcp_table(f.read(), local_port))
    return rows


def socket_owner(rows: Iterable[TcpSocket], peer: Endpoint, server: Endpoint) -> int | None:
    """The uid of the open socket at `peer` connected to `server` (the client's end of a connection
    that `server` accepted), or None when there is none on this machine. A row without an inode is
    a socket no process holds any more (closed, or a timewait one, which the kernel shows as uid 0):
    it proves nothing."""
    peer, server = (unmapped(peer[0]), peer[1]), (unmapped(server[0]), server[1])
    for row in rows:
        if row.local == peer and row.remote == server and row.inode:
            return row.uid
    return None


def listening_uids(rows: Iterable[TcpSocket], address: IPAddress, port: int) -> set[int]:
    """The uids of the listeners in `rows` that a connection to `address`:`port` may reach: on that
    address or a wildcard one (0.0.0.0, ::), IPv4 or IPv6."""
    wildcards = {ipaddress.IPv4Address(0), ipaddress.IPv6Address(0)}
    return {
        row.uid
        for row in rows
        if row.state == TCP_LISTEN and row.local[1] == port and row.local[0] in {unmapped(address), *wildcards}
    }


# -- the kernel's socket diagnostics ---------------------------------------------------------------
# One socket looked up by its addresses, where /proc/net/tcp prints every socket of the machine
# (10 ms a read here with 500 of them, and Gloo's ranks open a connection per request).

NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLMSG_ERROR = 1, 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
DIAG_REQUEST = struct.Struct("=BBBxI")  # family, protocol, extensions, states (then the socket id)
DIAG_MESSAGE = struct.Struct("=BBBB48sIIIII")  # family, state, timer, retransmits, id, expires, queues, uid, inode
ANYWHERE: Endpoint = (ipaddress.IPv4Address(0), 0)  # a listener's remote end


def _diag_socket_id(local: Endpoint, remote: Endpoint, family: int) -> bytes:
    """inet_diag_sockid: ports and addresses in network order, any interface, no cookie."""

    def address(a: IPAddress) -> bytes:
        if family == socket.AF_INET6 and isinstance(a, ipaddress.IPv4Address):
            a = ipaddress.IPv6Address("::ffff:" + str(a))
        return a.packed.ljust(16, b"\0")

    return (
        struct.pack("!HH", local[1], remote[1])
        + address(local[0])
        + address(remote[0])
        + struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    )


def _diag_lookup(local: Endpoint, remote: Endpoint) -> tuple[int, int] | None:
    """(uid, inode) of the socket the kernel finds for `local` and `remote`, as it would deliver a
    packet from `remote` to `local` (an established socket, else the listener that would take it);
    None when there is none; OSError where the kernel does not answer such questions."""
    local, remote = (unmapped(local[0]), local[1]), (unmapped(remote[0]), remote[1])
    families = [socket.AF_INET, socket.AF_INET6] if local[0].version == 4 else [socket.AF_INET6]
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as diag:
        diag.settimeout(1)
        for family in families:  # an IPv6 socket may hold an IPv4 address (mapped)
            request = DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)  # any state
            request += _diag_socket_id(local, remote, family)
            header = NLMSG_HEADER.pack(NLMSG_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
            diag.send(header + request)
            reply = diag.recv(8192)
            _, kind, _, _, _ = NLMSG_HEADER.unpack_from(reply)
            if kind == NLMSG_ERROR:  # ENOENT: no such socket in this family
                continue
            *_, uid, inode = DIAG_MESSAGE.unpack_from(reply, NLMSG_HEADER.size)
            return uid, inode
    return None


def diag_owner(peer: Endpoint, server: Endpoint) -> int | None:
    """socket_owner, asked of the kernel for the one socket; OSError where it does not answer."""
    found = _diag_lookup(peer, server)
    return found[0] if found and found[1] else None  # no inode: a socket no process holds (see socket_owner)


def peer_owner(peer: Endpoint, server: Endpoint) -> int | None:
    """The uid of the socket at `peer` connected to `server` on this machine: from the kernel's socket
    diagnostics, else from /proc/net/tcp (only the rows of the peer's port are parsed)."""
    try:
        return diag_owner(peer, server)
    except OSError:
        return socket_owner(read_tcp_tables(local_port=peer[1]), peer, server)


def listener_owners(address: IPAddress, port: int) -> set[int]:
    """The uids of whoever listens where a connection to `address`:`port` goes ({} for nobody): the
    one listener the kernel would hand it to (on that address, else a wildcard one, IPv4 or IPv6),
    else, where the kernel does not answer, every such listener in /proc/net/tcp and tcp6."""
    try:
        found = _diag_lookup((address, port), ANYWHERE)
    except OSError:
        return listening_uids(read_tcp_tables(local_port=port), address, port)
    return {found[0]} if found else set()
