"""torch's TCPStore, listening on one address only; and the session's rendezvous store of an elastic run:

    python -m cmlcluster.pytorch.store ADDRESS     stdin: the lifeline; prints the port it listens on

An elastic run's rendezvous (torchrun's c10d backend, every node a client: ``is_host=false``) keeps
its state in this store, hosted in a process of the session's, so that no worker's loss, rank 0's
included, takes the rendezvous down. It dies with the session however the session ends (_lifeline.py).
Session side: SessionStore. Only the standard library here at import time; torch when a store is made.
"""

from __future__ import annotations

import datetime
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .. import _lifeline
from .._proc import python_module

START_TIMEOUT = 60.0  # seconds for torch's import and the store's start
STOP_WAIT = 10.0


def listening_store(address: str, port: int) -> tuple[Any, socket.socket]:
    """A multi-tenant TCPStore server listening on address:port (port 0: one free there), and its socket.

    torch's own server would listen on every interface of the host. A multi-tenant TCPStore is one
    server per port in a process, so a store torch creates later on the same port in this process
    (torchrun's agent, or rank 0's process group) uses this one. Keep both until done with them.
    """
    from torch.distributed import TCPStore

    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(where)
    listener.listen(128)
    store = TCPStore(
        address,
        listener.getsockname()[1],
        is_master=True,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.fileno(),
    )
    return store, listener


class SessionStore:
    """The store process of one elastic run, started on `address` (where workers reach the session)."""

    def __init__(self, address: str):
        self.address = address
        self._log = tempfile.TemporaryFile()  # what it says when it fails to start
        self._process = subprocess.Popen(
            python_module(__name__, address),  # the notebook's folder not on its sys.path
            stdin=subprocess.PIPE,  # the lifeline: this process holds its only write end
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        try:
            self.port = self._read_port()
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    def _read_port(self) -> int:
        assert self._process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(timeout=0.2):
                    line = self._process.stdout.readline().strip()
                    if line.isdigit():
                        return int(line)
                    break  # it ended, or said something else
        self._log.seek(0)
        said = self._log.read().decode(errors="replace").strip().splitlines()[-10:]
        raise RuntimeError(
            f"the rendezvous store on {self.address} did not start (exit code {self._process.poll()}): "
            + ("\n".join(said) or f"no port within {START_TIMEOUT:g} s")
        )

    def close(self) -> None:
        """Pull the lifeline: the store's process group is killed; idempotent."""
        assert self._process.stdin is not None
        if not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, 9)
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._log.close()


def main(argv: list[str]) -> None:
    _lifeline.hold()
    _store, listener = listening_store(argv[0], 0)  # kept: serves until this process ends
    print(listener.getsockname()[1], flush=True)
    threading.Event().wait()  # serves from torch's threads until the lifeline ends this process group


if __name__ == "__main__":
    main(sys.argv[1:])
