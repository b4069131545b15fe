"""The session's side of an SSH worker: its connections to the worker's relay, one after another.

The worker runs under a relay on its host (ssh/relay.py), not under the ssh connection: a connection
that drops (ssh killed, its keepalives unanswered, sshd restarted, a NAT that forgot it) ends nothing
there. The session then connects again, with ``ssh host python -m cmlcluster.backends.ssh.remote
--attach <worker id>``, and tells the relay how much of the worker's output it has (``from <bytes>``):
what was written meanwhile, or lost on the way, comes again, so the worker's log holds it once and
in order. It tries until silence_timeout has passed since it last heard from the host (ssh's
keepalives give up after about half of it: cmlcluster/ssh/config.py); only then is the worker
reported lost, its reason saying so. The relay stops a worker that no connection reached within
silence_timeout; so does its agent's watchdog, without the controller's pings.

Each connection is one ssh process: its stdout carries the relay's frames, which a thread of the
session takes apart (the worker's output into its capped log, the exit code, notes), and its stdin
the session's lines (``from``, ``stop``, ``bye``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..._proc import signal_group
from ...logfile import READ_CHUNK, WorkerOutput, drained
from ...ssh.client import CONNECT_TIMEOUT
from ..base import OUTPUT_DRAIN_SECONDS
from .relay import EXIT, GONE_EXIT, HELLO, NOTE, OUTPUT, RAW, FrameReader

REMOTE = "cmlcluster.backends.ssh.remote"
LOST_HOST_EXIT = 255  # what ssh exits with when the connection fails or drops
ATTEMPT_TIMEOUT = 5  # one try at connecting again: a host that is back answers at once
RETRY_SECONDS = 1.0
ERROR_BYTES = 4096  # what is kept of an ssh process's stderr, for the reason a worker was lost

SshArgv = Callable[..., list[str]]  # (*command, connect_timeout=s) -> the ssh command line that runs it


class Link:
    """One ssh process carrying a connection to the relay, and the thread that takes apart what it brings."""

    def __init__(self, worker: RemoteWorker, process: asyncio.subprocess.Process, out: int, err: int):
        loop = asyncio.get_running_loop()
        self.process = process
        self.attached: asyncio.Future[None] = loop.create_future()  # the relay is on the other end
        self.copied: asyncio.Future[None] = loop.create_future()  # all it brought is in the log
        self.errors = b""  # ssh's stderr (its last ERROR_BYTES): why a connection failed
        self.stop_sent = False
        self._worker, self._out, self._err, self._loop = worker, out, err, loop
        self._wake_read, self._wake_write = os.pipe()
        name = f"cmlcluster-ssh-{worker.worker_id}"
        threading.Thread(target=self._copy, name=name, daemon=True).start()

    def send(self, line: str) -> None:
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            with contextlib.suppress(OSError, RuntimeError):
                stdin.write(line.encode())

    def said(self) -> str:
        """ssh's last line on stderr: "Timeout, server 10.0.0.5 not responding.", say."""
        lines = [line.strip() for line in self.errors.decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def stop_copying(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")

    def _bye(self) -> None:
        """The exit code is in: the relay may go, and this connection with it."""
        self.send("bye\n")
        if self.process.stdin is not None:
            self.process.stdin.close()

    def _copy(self) -> None:
        reader: FrameReader | None = FrameReader()
        poller = select.poll()
        open_fds = {self._out, self._err}
        for fd in (*open_fds, self._wake_read):
            poller.register(fd, select.POLLIN)
        try:
            while open_fds:
                events = poller.poll()
                if any(fd == self._wake_read for fd, _ in events):
                    return
                for fd, _ in events:
                    data = os.read(fd, READ_CHUNK)
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                    elif fd == self._err:
                        self.errors = (self.errors + data)[-ERROR_BYTES:]
                    elif reader is None:
                        self._worker.write(data)
                    else:
                        try:
                            frames = reader.feed(data)
                        except ValueError as e:  # not the relay's stream: kept as it came, for whoever reads the log
                            reader, frames = None, [(NOTE, str(e).encode())]
                        for kind, payload in frames:
                            self._on_frame(kind, payload)
        finally:
            for fd in (self._out, self._err, self._wake_read, self._wake_write):
                os.close(fd)
            if self.errors:  # ssh's last words (why it ended), after all that came before them
                self._worker.write_line(self.errors.decode(errors="replace").rstrip("\n"))
            with contextlib.suppress(RuntimeError):  # the session's loop is gone
                self._loop.call_soon_threadsafe(_settle, self.copied)

    def _on_frame(self, kind: bytes, payload: bytes) -> None:
        worker = self._worker
        if kind == OUTPUT:
            worker.write(payload)
            worker.received += len(payload)
        elif kind == RAW:  # a login script's chatter before the relay spoke
            worker.write(payload)
        elif kind == NOTE:
            worker.write_line(f"[cmlcluster: {payload.decode(errors='replace')}]")
        elif kind == HELLO:
            self._loop.call_soon_threadsafe(_settle, self.attached)
        elif kind == EXIT:
            worker.exit_code = int(payload)
            self._loop.call_soon_threadsafe(self._bye)


class RemoteWorker:
    """One worker on an SSH host, as the session sees it: Spawner-like start, poll, finished, stop; the
    connection dropping and coming back is its own business. `reason` says why it was lost, when it was."""

    def __init__(
        self, worker_id: str, host: str, ssh: SshArgv, *, python: str, log_path: str, silence: float, keepalive: float
    ):
        self.worker_id, self.host, self.python = worker_id, host, python
        self.log_path = log_path
        self.silence = silence  # the session's silence_timeout
        self.keepalive = keepalive  # how long ssh goes unanswered before it gives up on a connection
        self.received = 0  # bytes of the worker's output in its log (its relay counts the same way)
        self.exit_code: int | None = None  # the worker's, from its relay
        self.reason: str | None = None
        self.reconnections = 0
        self.link: Link | None = None
        self.output: WorkerOutput | None = None
        self._ssh = ssh
        self._stop_grace: float | None = None
        self._given_up = asyncio.Event()
        self._line_open = False
        self._task: asyncio.Task[int] | None = None

    async def start(self, request: dict[str, Any]) -> None:
        """Start the worker on its host. Raises OSError when ssh cannot be started, leaving nothing behind."""
        self.output = WorkerOutput(self.log_path)  # held open across connections: one log, written in order
        try:
            argv = self._ssh(self.python, "-m", REMOTE, connect_timeout=CONNECT_TIMEOUT)
            link = await self._connect(argv, json.dumps(request) + "\nfrom 0\n")
        except BaseException:
            self.output.close()
            raise
        self._task = asyncio.ensure_future(self._supervise(link))

    def poll(self) -> int | None:
        return self._task.result() if self._task is not None and self._task.done() else None

    async def finished(self) -> int:
        """Its exit code, once it ended and all of its output is in the log."""
        assert self._task is not None
        code = await asyncio.shield(self._task)
        if self.output is not None:
            self.output.handed_over()  # no connection writes to the log any more: its copy may end
        await drained(self.output, OUTPUT_DRAIN_SECONDS)
        return code

    async def stop(self, grace: float) -> None:
        """TERM, KILL after `grace` s, on the host; a host that does not answer is given up after grace +
        CONNECT_TIMEOUT (its relay and its agent's watchdog end the worker there). Idempotent."""
        if self._task is None:
            return
        if not self._task.done():
            if self._stop_grace is None:
                self._stop_grace = grace
            link = self.link
            if link is not None and not link.stop_sent:  # one being made says it as it starts
                link.stop_sent = True
                link.send(f"stop {grace:g}\n")
            try:
                await asyncio.wait_for(asyncio.shield(self._task), grace + CONNECT_TIMEOUT)
            except asyncio.TimeoutError:
                self._given_up.set()
                if self.link is not None and self.link.process.returncode is None:  # reaped: its pid is not its own
                    signal_group(self.link.process.pid, signal.SIGKILL)
        await self.finished()

    # ------------------------------------------------------------ connections

    async def _connect(self, argv: list[str], first_lines: str) -> Link:
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=out_write,
                stderr=err_write,
                start_new_session=True,  # the notebook's Ctrl-C is not the worker's
            )
        except BaseException:
            os.close(out_read)
            os.close(err_read)
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        link = self.link = Link(self, process, out_read, err_read)
        if self._stop_grace is not None:
            link.stop_sent = True
            first_lines += f"stop {self._stop_grace:g}\n"
        link.send(first_lines)
        return link

    async def _ended(self, link: Link) -> int:
        """The ssh process's exit code, once all it brought is in the log."""
        code = await link.process.wait()
        if not (await asyncio.wait([link.copied], timeout=OUTPUT_DRAIN_SECONDS))[0]:
            link.stop_copying()  # something it started still holds its pipes: not waited for
            await link.copied
        return code

    async def _supervise(self, link: Link) -> int:
        try:
            while True:
                code = await self._ended(link)
                if self.exit_code is not None:
                    return self.exit_code
                if self._given_up.is_set():
                    return code
                if not link.attached.done():  # the first connection never reached a relay: nothing runs
                    if code == LOST_HOST_EXIT:
                        self.reason = f"lost the SSH connection to {self.host}" + _colon(link.said())
                    return code
                next_link = await self._reconnect(link, code)
                if next_link is None:
                    return LOST_HOST_EXIT
                link = next_link
        except Exception as e:  # a bug here must not leave the worker's end unreported
            self.reason = f"lost track of the worker on {self.host}: {type(e).__name__}: {e}"
            return LOST_HOST_EXIT

    async def _reconnect(self, lost: Link, code: int) -> Link | None:
        """A new connection to the relay, tried until silence_timeout has passed since the host last
        answered; None when none came (self.reason says why)."""
        loop = asyncio.get_running_loop()
        first = lost.said() or (f"ssh was killed by signal {-code}" if code < 0 else f"ssh exited with code {code}")
        # ssh gives up after its keepalives went unanswered for self.keepalive s: the silence began then.
        deadline = loop.time() + self.silence - (self.keepalive if "Timeout" in first else 0.0)
        began = loop.time()
        await asyncio.to_thread(
            self.write_line,
            f"[cmlcluster: the SSH connection to {self.host} dropped ({first}); connecting again, for up to "
            f"{max(0.0, deadline - began):.0f} s]",
        )
        last = ""
        while not self._given_up.is_set() and loop.time() < deadline:
            remaining = deadline - loop.time()
            command = (self.python, "-m", REMOTE, "--attach", self.worker_id)
            try:
                link = await self._connect(
                    self._ssh(*command, connect_timeout=max(1, min(ATTEMPT_TIMEOUT, math.ceil(remaining)))),
                    f"from {self.received}\n",
                )
            except OSError as e:
                last = str(e)
            else:
                ended = asyncio.ensure_future(link.process.wait())
                give_up = asyncio.ensure_future(self._given_up.wait())
                waits: list[asyncio.Future[Any]] = [link.attached, ended, give_up]
                await asyncio.wait(waits, timeout=remaining + 1, return_when=asyncio.FIRST_COMPLETED)
                give_up.cancel()
                if link.attached.done():
                    ended.cancel()
                    self.reconnections += 1
                    note = f"[cmlcluster: connected to {self.host} again after {loop.time() - began:.1f} s]"
                    await asyncio.to_thread(self.write_line, note)
                    return link
                if not ended.done():  # it hangs past the deadline
                    signal_group(link.process.pid, signal.SIGKILL)
                attempt_code = await self._ended(link)
                if attempt_code == GONE_EXIT:
                    self.reason = f"lost the SSH connection to {self.host} ({first}); connected again: {link.said()}"
                    return None
                last = link.said() or f"ssh exited with code {attempt_code}"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._given_up.wait(), min(RETRY_SECONDS, max(0.0, deadline - loop.time())))
        again = f"; last try: {last.rstrip('.')}" if last and last != first else ""
        self.reason = (
            f"lost the SSH connection to {self.host} and could not connect again within silence_timeout "
            f"({self.silence:g} s): {first.rstrip('.')}{again}"
        )
        return None

    # ------------------------------------------------------------ the log (one writer at a time: a link's thread)

    def write(self, data: bytes) -> None:
        output = self.output
        if output is None or output.write_fd < 0 or not data:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(output.write_fd, view) :]
        except OSError:  # the log's copy was given up (drain's timeout): nothing more goes in
            return
        self._line_open = not data.endswith(b"\n")

    def write_line(self, text: str) -> None:
        """A line of cmlcluster's (or ssh's) in the log, on a line of its own."""
        self.write((("\n" if self._line_open else "") + text + "\n").encode(errors="replace"))


def _colon(text: str) -> str:
    return f": {text}" if text else ""


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
