"""A worker's web app, reached at its own address: a TCP relay from there to the app on its loopback.

CML's docs tell a web app to listen on 127.0.0.1 at CDSW_APP_PORT (Ray's dashboard binds 127.0.0.1 too),
and CML's proxy reaches it from inside the engine. cmlcluster has no proxy inside a worker, and a worker
whose address is not this machine's loopback (a container, a pod, an SSH host) cannot be reached at
127.0.0.1 from outside. So its agent runs this forwarder: it listens on the worker's own address
(CDSW_IP_ADDRESS) at a port of its own (wire.APP_FORWARD_PORT_ENV; app_ports.pick draws it) and relays
each connection to 127.0.0.1:<CDSW_APP_PORT>, where an app bound to 127.0.0.1 or to 0.0.0.0 answers.
`app_url` names that port (app_ports.worker_app_url). Not the app's own port on the worker's address: an
app binding 0.0.0.0 would find it taken.

- It listens on the worker's own address only, never wider.
- A connection while no app listens is closed at once, as the app's port itself would refuse it.
- It relays only to a listener of the agent's own user (the kernel names whose, socket_owners.py):
  on an SSH host the port was drawn free on the session's machine, not the host's, and another
  user's service bound to 127.0.0.1 there must not become reachable from the network through it.
  A connection while another user's listener holds the port is closed, and said once in the log.
- An end of data on one side is passed on to the other (a half-close); the relay ends once both
  directions have, or at the first error on either side, which closes both.
- One daemon thread with its own asyncio loop, idle in epoll while nobody connects: the engine's loop
  is busy while the worker's program (often the app itself) runs. The listening socket is not
  inherited by the program's processes and goes with the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Mapping

from .. import socket_owners, wire

Say = Callable[[str], None]
LOOPBACK = "127.0.0.1"  # where CML's docs tell apps to listen
CHUNK = 64 << 10


class Forwarder:
    """Relays each connection to `listener` (bound and listening) to 127.0.0.1:`target_port`, while a
    socket of this process's user listens there; `say` tells the worker's log once when another's does."""

    def __init__(self, listener: socket.socket, target_port: int, say: Say):
        self.listener = listener
        self.target = (LOOPBACK, target_port)
        self.say = say
        self.uid = os.geteuid()  # whose sockets the kernel names as this process's
        self._said_stranger = False
        self._loop = asyncio.new_event_loop()
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def start(self) -> Forwarder:
        self.thread = threading.Thread(target=self._run, name="cmlcluster-app-forward", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and end the relays (from any thread; the thread ends soon after)."""
        with contextlib.suppress(RuntimeError):  # its loop already closed
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            try:
                server = loop.run_until_complete(asyncio.start_server(self._relay, sock=self.listener))
            except RuntimeError:  # stop() came first: the loop stopped under run_until_complete (seen in CI)
                server = None
            if server is not None:
                loop.run_forever()
                server.close()
            relays = asyncio.all_tasks(loop)  # the relays, or the start that stop() came before
            for relay in relays:
                relay.cancel()
            loop.run_until_complete(asyncio.gather(*relays, return_exceptions=True))
        finally:
            self.listener.close()
            loop.close()

    def _app_is_ours(self) -> bool:
        """Whether the listener a connection to the target would reach is this user's; False for none."""
        owners = socket_owners.listener_owners(ipaddress.ip_address(self.target[0]), self.target[1])
        if owners - {self.uid} and not self._said_stranger:
            self._said_stranger = True
            self.say(
                f"its app_url relays nothing: {LOOPBACK}:{self.target[1]} (its CDSW_APP_PORT) is listened on by "
                f"another user's process (uid {', '.join(map(str, sorted(owners - {self.uid})))}), not this "
                "worker's; connections to its app_url are closed while it does"
            )
        return owners == {self.uid}

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if not self._app_is_ours():  # nobody listens (the port would refuse it), or another user does
            client_writer.close()
            return
        try:
            app_reader, app_writer = await asyncio.open_connection(*self.target)
        except OSError:  # no app listens (yet): closed, as a connection to its port would be
            client_writer.close()
            return
        writers = (client_writer, app_writer)
        try:
            await asyncio.gather(
                _pump(client_reader, app_writer, writers),
                _pump(app_reader, client_writer, writers),
            )
        finally:
            for writer in writers:
                writer.close()


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, both: tuple[asyncio.StreamWriter, ...]
) -> None:
    """One direction of a relay: bytes until the end of data, which is passed on as a half-close. An
    error closes both sides, which ends the other direction too (its read sees the end)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        for each in both:
            each.close()


def start(environ: Mapping[str, str], listen_port: str, say: Say) -> Forwarder | None:
    """The agent's forwarder from CDSW_IP_ADDRESS:`listen_port` to 127.0.0.1:<CDSW_APP_PORT>, listening
    when this returns; None when there is none to run (no port given) or it cannot listen, said in the
    worker's log: the worker runs on without it."""
    if not listen_port:
        return None
    address, app_port = environ.get("CDSW_IP_ADDRESS", ""), environ.get(wire.APP_PORT_ENVS[0], "")
    try:
        if not address:  # "" would bind every address of the worker
            raise ValueError("CDSW_IP_ADDRESS is not set")
        port, target = int(listen_port), int(app_port)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.create_server((address, port), family=family)
    except (ValueError, OSError) as e:
        say(
            f"its app is not reachable at its app_url: cannot forward {address}:{listen_port} to "
            f"{LOOPBACK}:{app_port} ({e}); an app listening on all its addresses answers at its CDSW_APP_PORT"
        )
        return None
    return Forwarder(listener, target, say).start()
