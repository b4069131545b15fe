"""Ports: picking free ones, and waiting for a server to accept. Used in workers and in the session."""

from __future__ import annotations

import contextlib
import ipaddress
import random
import socket
import time

LISTEN_PORTS_FROM = 10_000  # ports_to_listen_on's range starts here (below: well-known services)


def free_ports(n: int) -> list[int]:
    """n distinct ports free on this host now (held together while picked, so no two are the same),
    each reserved (see _reserve) for its server to bind: a server binding with SO_REUSEADDR, as
    TensorFlow's gRPC servers, torch's TCPStore and sshd do (each checked on a reserved port).

    Callers pick again per run, never a fixed port, so a port left in use by an earlier run never
    blocks the next one.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        for s in sockets:
            _reserve(s)
        return [s.getsockname()[1] for s in sockets]


def ports_to_listen_on(n: int, host: str = "", *, reserve: bool = True) -> list[int]:
    """n distinct ports free on `host` now, for servers that will bind them a moment later.

    Drawn from below the kernel's ephemeral range: free_ports' ports come from that range, where
    any outgoing connection may take one (the kernel picks its local port there) before the
    server binds it; up to 15 ports held open for a second on a busy machine are worth keeping
    out of its way.

    Each is left reserved (see _reserve) for its server to bind: another session starting on this
    host at the same moment could draw the same port before it was bound (a CI run: two sessions'
    controllers, one failing with "Address already in use"). The server must bind with
    SO_REUSEADDR, as zmq and gRPC do. reserve=False leaves them free for any server (one that may
    bind without SO_REUSEADDR, as a user's web app may), at the risk of that race.
    """
    ephemeral_from = _ephemeral_range_start()
    candidates = random.sample(range(LISTEN_PORTS_FROM, ephemeral_from), ephemeral_from - LISTEN_PORTS_FROM)
    with contextlib.ExitStack() as stack:
        chosen: list[socket.socket] = []
        for port in candidates:
            held = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                held.bind((host, port))
            except OSError:
                continue
            chosen.append(held)
            if len(chosen) == n:
                for held in chosen if reserve else ():
                    _reserve(held)
                return [held.getsockname()[1] for held in chosen]
    raise OSError(f"fewer than {n} free ports between {LISTEN_PORTS_FROM} and {ephemeral_from} on this host")


def _reserve(held: socket.socket) -> None:
    """Leave held's port reserved for a minute: taken for a plain bind, free for SO_REUSEADDR's.

    One connection to it, closed first on its side, waits in TIME_WAIT on the port for 60 s
    (Linux): a bind without SO_REUSEADDR (ports_to_listen_on's, in any session) fails there, and
    a server binding with SO_REUSEADDR gets it, because its listener had it. held was bound
    without it, so the port was free of every other claim; the listener is on loopback only (or
    held's own address), so that nothing listens on every interface, even for a moment.
    """
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # after its bind: others' plain binds still fail
    host, port = held.getsockname()
    on = "127.0.0.1" if ipaddress.ip_address(host).is_unspecified else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((on, port))
        listener.listen(1)
        with socket.create_connection((on, port), timeout=5):
            accepted, _ = listener.accept()
            accepted.close()


def _ephemeral_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(LISTEN_PORTS_FROM + 1_000, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def route_address(peer: str) -> str:
    """This host's IPv4 address on its route to `peer`, a name or an address (no packet is sent)."""
    address = socket.getaddrinfo(peer, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def wait_until_accepting(host: str, port: int, timeout: float) -> float:
    """Wait until host:port accepts a TCP connection; return the seconds it took.

    Raises TimeoutError naming the endpoint when it does not within `timeout` seconds.
    """
    started = time.monotonic()
    last_error: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return time.monotonic() - started
        except OSError as e:
            last_error = e
        if time.monotonic() - started > timeout:
            raise TimeoutError(
                f"{host}:{port} did not accept connections within {timeout:g} s "
                f"(last attempt from {socket.gethostname()}: {last_error})"
            )
        time.sleep(0.1)
