"""Ports: picking free ones, and waiting for a server to accept. Used in workers and in the session."""

from __future__ import annotations

import contextlib
import socket
import time


def free_ports(n: int) -> list[int]:
    """n distinct ports free on this host now (held together while picked, so no two are the same).

    Another process may take one before its server binds it; callers pick again per run, never
    a fixed port, so a port left in use by an earlier run never blocks the next one.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


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
