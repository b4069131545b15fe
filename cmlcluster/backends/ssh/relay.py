"""An SSH worker's relay, on its host: what keeps the worker going when its ssh connection drops.

The relay is the worker agent's parent (ssh/remote.py forks it, in a session of its own, outside
the ssh login). It reads the agent's output from a pipe and keeps its last SPOOL_BYTES (logfile's
TAIL_BYTES, 8 MiB) by offset from the start, and serves one connection at a time: the session's
ssh, through a bridge process in that ssh login (ssh_remote.bridge), first over a socket pair and
later over a unix socket in the worker's private folder (0700, only its user). A connection that
drops leaves the worker running; the session connects again (``ssh_remote --attach``) and says
from which offset it has the output, so what it missed comes again, in order, once.

On each connection the relay speaks first: MAGIC, then frames (a kind byte, a 4-byte length, the
bytes): OUTPUT (the agent's, from the offset asked), NOTE (a line for the worker's log) and EXIT
(the exit code, after the last output). The session answers in lines: ``from <offset>``,
``stop <grace>``, ``bye`` (it has the exit code: the relay may go) and ``closed`` (its input
ended while the connection held: the session is gone, so the worker stops, as before relays).

Without a connection for silence_timeout seconds the worker is stopped; a worker that ended is
kept (its exit code and last output) as long for a connection to come and collect them.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable

from ...wire import READ_CHUNK, TAIL_BYTES

SPOOL_BYTES = TAIL_BYTES  # what a worker's log keeps of its tail is what its relay keeps for a new connection
MAGIC = b"\x00cmlcluster-relay-1\n"  # what comes before it on a connection is a login script's chatter
HEADER = struct.Struct(">cI")
OUTPUT, NOTE, EXIT = b"o", b"n", b"x"
HELLO, RAW = b"h", b"r"  # what FrameReader gives for MAGIC and for the bytes before it
FRAME_BYTES = 64 << 10
GONE_EXIT = 69  # `ssh_remote --attach`: no relay of that worker on this host (it ended, or never ran here)
SOCKET_NAME = "attach.sock"  # in the worker's folder, bound and reached from there (paths over 107 bytes)
HANGUP_MS = 250  # a dropped ssh login closes a command's input and output at once; a session its input only
POLL_MS = 250


def frame(kind: bytes, payload: bytes) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


class FrameReader:
    """Frames from a byte stream fed in pieces: (kind, payload), with (HELLO, b"") for MAGIC and
    (RAW, bytes) for whatever came before it."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._synced = False

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buffer += data
        found: list[tuple[bytes, bytes]] = []
        if not self._synced:
            at = self._buffer.find(MAGIC)
            raw = len(self._buffer) - (len(MAGIC) - 1) if at < 0 else at  # MAGIC may be split across reads
            if raw > 0:
                found.append((RAW, bytes(self._buffer[:raw])))
                del self._buffer[:raw]
            if at < 0:
                return found
            del self._buffer[: len(MAGIC)]
            self._synced = True
            found.append((HELLO, b""))
        while len(self._buffer) >= HEADER.size:
            kind, size = HEADER.unpack_from(self._buffer)
            if size > FRAME_BYTES:
                raise ValueError(f"a frame of {size} bytes from the relay: the stream is not the relay's")
            if len(self._buffer) < HEADER.size + size:
                break
            found.append((kind, bytes(self._buffer[HEADER.size : HEADER.size + size])))
            del self._buffer[: HEADER.size + size]
        return found


class Spool:
    """The agent's output by offset from its start; its last `cap` bytes kept for a connection to come."""

    def __init__(self, cap: int = SPOOL_BYTES):
        self.cap = cap
        self.start = 0  # the offset of the oldest byte kept
        self._data = bytearray()

    @property
    def end(self) -> int:
        return self.start + len(self._data)

    def add(self, data: bytes) -> None:
        self._data += data
        extra = len(self._data) - self.cap
        if extra > 0:
            del self._data[:extra]  # cheap: a bytearray drops its front without copying the rest
            self.start += extra

    def read(self, offset: int, limit: int) -> bytes:
        at = max(0, offset - self.start)
        return bytes(self._data[at : at + limit])


class Connection:
    """The relay's end of one connection: what came in (lines), what waits to go out (frames)."""

    def __init__(self, sock: socket.socket, sent: int):
        sock.setblocking(False)
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray(MAGIC)
        self.sent = sent  # the output offset up to which frames are in the outbox or gone
        self.ready = False  # the session said from which offset it wants the output
        self.exit_queued_at: float | None = None


class Relay:
    """The relay's loop: the agent's output into the spool and out to the connection; the session's
    lines in; the silence_timeout kept. run() returns once the worker ended and its exit code went
    to the session (or could not, within silence_timeout)."""

    def __init__(self, first: socket.socket, listener: socket.socket, silence_timeout: float):
        self.listener = listener
        self.silence = silence_timeout
        self.spool = Spool(SPOOL_BYTES)
        self.connection: Connection | None = Connection(first, 0)
        self.detached_at: float | None = None
        self.code: int | None = None  # the worker's exit code, once it ended
        self.output_fd = -1
        self.process: subprocess.Popen[bytes] | None = None
        self.end_worker: Callable[[float], None] = lambda grace: None
        self.stopping = False
        self.session_gone = False
        self.delivered = False
        self._drain_until = 0.0
        self._wake_read, self._wake_write = os.pipe()

    # ------------------------------------------------------------ the worker's side

    def watch(self, process: subprocess.Popen[bytes], output_fd: int, end_worker: Callable[[float], None]) -> None:
        """Relay `process`'s output (the read end of its stdout); end_worker(grace) ends its process group."""
        self.process, self.output_fd, self.end_worker = process, output_fd, end_worker
        threading.Thread(target=self._wait, daemon=True).start()

    def never_started(self, why: str) -> None:
        self.note(why)
        self.code = 127

    def _wait(self) -> None:
        assert self.process is not None
        self.process.wait()
        os.write(self._wake_write, b"x")

    def stop(self, grace: float) -> None:
        """End the worker: TERM, KILL after grace (on a thread: its output goes on being relayed meanwhile)."""
        if self.stopping or self.code is not None:
            return
        self.stopping = True
        threading.Thread(target=self.end_worker, args=(grace,), daemon=True).start()

    def note(self, text: str) -> None:
        if self.connection is not None:
            self.connection.outbox += frame(NOTE, text.encode(errors="replace")[:FRAME_BYTES])

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        poller = select.poll()
        while not self._done():
            fds = self._register(poller)
            for fd, events in poller.poll(POLL_MS):
                self._on(fd, events)
            for fd in fds:
                poller.unregister(fd)
            self._check_clocks()
        connection = self.connection
        if connection is not None:  # a last try at what it still has to send: the session may be gone
            self._fill(connection, limit=SPOOL_BYTES + FRAME_BYTES)
            with contextlib.suppress(OSError):
                connection.sock.settimeout(1.0)
                connection.sock.sendall(connection.outbox)
        # The connection stays open until this process exits, after the worker's folder is cleaned up:
        # the session's ssh ends then, and what the session does next on the host finds it done.
        return self.code if self.code is not None else 1

    def _register(self, poller: select.poll) -> list[int]:
        fds = {self.listener.fileno(): select.POLLIN, self._wake_read: select.POLLIN}
        connection = self.connection
        if self.output_fd >= 0 and (connection is None or self.spool.end - connection.sent < SPOOL_BYTES):
            fds[self.output_fd] = select.POLLIN  # else the connection is behind: the agent waits (nothing lost)
        if connection is not None:
            self._fill(connection)
            fds[connection.sock.fileno()] = select.POLLIN | (select.POLLOUT if connection.outbox else 0)
        for fd, mask in fds.items():
            poller.register(fd, mask)
        return list(fds)

    def _on(self, fd: int, events: int) -> None:
        connection = self.connection
        if fd == self._wake_read:
            os.read(self._wake_read, 1)
            assert self.process is not None
            code = self.process.returncode
            self.end_worker(0)  # the agent is gone; whatever its program left goes too
            self.code = code if code >= 0 else 128 - code
            self._drain_until = time.monotonic() + 5.0  # then its output ends, or is given up
        elif fd == self.listener.fileno():
            self._accept()
        elif fd == self.output_fd:
            room = SPOOL_BYTES if connection is None else SPOOL_BYTES - (self.spool.end - connection.sent)
            data = os.read(fd, max(1, min(READ_CHUNK, room)))
            if data:
                self.spool.add(data)
            else:
                self._close_output()
        elif connection is not None and fd == connection.sock.fileno():
            if events & select.POLLOUT:
                self._send(connection)
            if events & (select.POLLIN | select.POLLHUP | select.POLLERR) and self.connection is connection:
                self._receive(connection)

    def _close_output(self) -> None:
        if self.output_fd >= 0:
            os.close(self.output_fd)
            self.output_fd = -1

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # the folder is 0700 already; this says so again
            sock.close()
            return
        if self.connection is not None:  # a connection that the session gave up on: the new one replaces it
            self.connection.sock.close()
        self.connection = Connection(sock, self.spool.start)
        self.detached_at = None

    def _drop(self) -> None:
        if self.connection is not None:
            self.connection.sock.close()
        self.connection = None
        self.detached_at = time.monotonic()

    def _receive(self, connection: Connection) -> None:
        try:
            data = connection.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop()
            return
        connection.inbox += data
        while b"\n" in connection.inbox:
            line, _, rest = bytes(connection.inbox).partition(b"\n")
            connection.inbox[:] = rest
            self._command(connection, line.decode(errors="replace").split())

    def _command(self, connection: Connection, words: list[str]) -> None:
        word, value = [*words, "", ""][:2]
        if word == "from" and value.isdigit():
            offset = min(int(value), self.spool.end)
            if offset < self.spool.start:
                self.note(
                    f"{self.spool.start - offset:,} bytes of output lost here while the SSH connection was "
                    f"down (its host keeps the last {SPOOL_BYTES:,} bytes)"
                )
            connection.sent, connection.ready = max(offset, self.spool.start), True
        elif word == "stop":
            try:
                grace = float(value)
            except ValueError:
                grace = 5.0
            self.stop(grace)
        elif word == "bye":
            self.delivered = True
        elif word == "closed":  # the session is gone: stop the worker as it always did, and wait for no one
            self.session_gone = True
            self.stop(5.0)

    def _fill(self, connection: Connection, limit: int = 2 * FRAME_BYTES) -> None:
        while connection.ready and len(connection.outbox) < limit and connection.sent < self.spool.end:
            chunk = self.spool.read(connection.sent, FRAME_BYTES)
            connection.outbox += frame(OUTPUT, chunk)
            connection.sent += len(chunk)
        finished = self.code is not None and self.output_fd < 0
        if finished and connection.ready and connection.sent == self.spool.end and connection.exit_queued_at is None:
            connection.outbox += frame(EXIT, str(self.code).encode())
            connection.exit_queued_at = time.monotonic()

    def _send(self, connection: Connection) -> None:
        try:
            sent = connection.sock.send(connection.outbox)
        except BlockingIOError:
            return
        except OSError:
            self._drop()
            return
        del connection.outbox[:sent]

    def _check_clocks(self) -> None:
        now = time.monotonic()
        if self.code is not None and self.output_fd >= 0 and now > self._drain_until:
            self._close_output()  # a process that escaped the end still holds the pipe: not waited for
        if self.detached_at is not None and now - self.detached_at > self.silence and self.code is None:
            self.stop(5.0)  # no connection came back within silence_timeout

    def _done(self) -> bool:
        if self.code is None or self.output_fd >= 0:
            return False
        if self.delivered or self.session_gone:
            return True
        now = time.monotonic()
        if self.connection is None:
            return self.detached_at is not None and now - self.detached_at > self.silence
        queued = self.connection.exit_queued_at
        return queued is not None and now - queued > self.silence  # sent, and no answer: not waited for longer


def end_worker_on_signals(relay: Relay) -> None:
    """SIGTERM to the relay (the host shutting down, say) stops the worker like `stop`; SIGHUP is not for it."""
    signal.signal(signal.SIGTERM, lambda *_: relay.stop(5.0))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
