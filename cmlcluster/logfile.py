"""A worker's log file in bounded space: its first part, then a rolling tail.

A worker may print for weeks, and its log (``<worker id>.log`` in the session's log folder, kept after
the session: worker_logs.py) must not fill a disk. So a log keeps the first HEAD_BYTES its process
wrote (how it started: its imports, its first errors), then the last TAIL_BYTES / 2 to TAIL_BYTES:
when the tail would pass TAIL_BYTES, its older half goes, and a marker line between the head and the
tail says how many bytes were dropped. Rolling writes a new file and renames it over the old one, so a
reader by path (such as read_tail) sees the one file or the other, never one half-written.

Every backend copies its workers' output into their CappedLog on a thread of the session: Docker's
and Kubernetes' from their log streams, and the local and SSH backends from a pipe (WorkerOutput)
that their worker processes write their stdout and stderr to, instead of writing to the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from typing import TYPE_CHECKING, Any

from .wire import READ_CHUNK, TAIL_BYTES

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

HEAD_BYTES = 1 << 20  # 1 MiB
# The tail that a roll keeps begins at a line's start when one begins at most this far before it.
LINE_SEARCH = 64 << 10


class CappedLog:
    """A log file that keeps its first `head` bytes and its last `tail` / 2 to `tail`. One writer.

    head, tail: None for HEAD_BYTES and TAIL_BYTES as they are when the log is opened (tests set them).
    """

    def __init__(self, path: str, head: int | None = None, tail: int | None = None):
        self.path = path
        self.head = HEAD_BYTES if head is None else head
        self.tail = TAIL_BYTES if tail is None else tail
        self.dropped = 0
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = _open_private(path)  # read back as it rolls
        self._head_size = 0  # bytes of the head in the file
        self._tail_start = 0  # where the tail begins in the file (after the head and the marker)
        self._tail_size = 0

    def write(self, data: bytes) -> None:
        if self._head_size < self.head:
            part = data[: self.head - self._head_size]
            _write_all(self._file, part)
            self._head_size += len(part)
            self._tail_start = self._head_size
            data = data[len(part) :]
        if not data:
            return
        if self._tail_size + len(data) <= self.tail:
            _write_all(self._file, data)
            self._tail_size += len(data)
        else:
            self._roll(data)

    def _roll(self, data: bytes) -> None:
        """The head, the marker and the tail's newer half (at least tail / 2 bytes, back to a line's
        start when one begins near), into a new file that takes the old one's place. What stays is
        copied by the kernel (copy_file_range): a worker that floods its output pays little for it."""
        keep = self.tail // 2
        old_size, total = self._tail_size, self._tail_size + len(data)
        cut = total - keep  # where the kept part begins, counted from the start of the tail
        search_from = max(0, cut - min(LINE_SEARCH, keep // 4))  # the rest stays well below the tail
        newline = self._tail_bytes(data, search_from, cut).rfind(b"\n")
        if newline >= 0:
            cut = search_from + newline + 1
        self.dropped += cut
        old = self._file.fileno()
        last_head_byte = os.pread(old, 1, self._head_size - 1) if self._head_size else b"\n"
        marker = (
            f"[cmlcluster: {self.dropped:,} bytes of output dropped here; a worker's log keeps its first "
            f"{_size(self.head)} and its last {_size(keep)} to {_size(self.tail)}]\n"
        ).encode()
        if last_head_byte != b"\n":
            marker = b"\n" + marker
        rolling = self.path + ".rolling"
        new = _open_private(rolling)
        try:
            _copy_range(old, new, 0, self._head_size)
            _write_all(new, marker)
            if cut < old_size:
                _copy_range(old, new, self._tail_start + cut, old_size - cut)
            _write_all(new, data[max(0, cut - old_size) :])
            os.replace(rolling, self.path)
        except BaseException:
            new.close()
            with contextlib.suppress(OSError):
                os.unlink(rolling)
            raise
        self._file.close()
        self._file = new
        self._tail_start = self._head_size + len(marker)
        self._tail_size = total - cut

    def _tail_bytes(self, data: bytes, start: int, stop: int) -> bytes:
        """Bytes start:stop of the tail in the file followed by `data`."""
        in_file = b""
        if start < self._tail_size:
            in_file = os.pread(self._file.fileno(), min(stop, self._tail_size) - start, self._tail_start + start)
        return in_file + data[max(0, start - self._tail_size) : max(0, stop - self._tail_size)]

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CappedLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_private(path: str) -> Any:
    """`path` made empty and the user's alone (0600, whatever the umask, and an existing file's mode too):
    a log holds whatever a worker printed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return open(fd, "w+b", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _copy_range(source: int, file: Any, offset: int, count: int) -> None:
    """`count` bytes of the file `source` from `offset`, appended to `file`: in the kernel where it can."""
    while count > 0:
        try:
            copied = os.copy_file_range(source, file.fileno(), count, offset)
        except (AttributeError, OSError):  # not Linux, or a filesystem without it
            copied = file.write(os.pread(source, min(count, 1 << 20), offset))
        if not copied:
            raise OSError(f"{count} bytes short: the log file was cut while it rolled")
        offset, count = offset + copied, count - copied


def _write_all(file: Any, data: bytes) -> None:
    """All of `data`: an unbuffered file may write a part (a signal, a disk nearly full)."""
    view = memoryview(data)
    while view:
        view = view[file.write(view) :]


def read_tail(path: str, limit: int) -> str:
    """The last `limit` bytes of the log at `path`, as text ("" when there is none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _size(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,} bytes"


class WorkerOutput:
    """Where a worker's process writes its stdout and stderr: a pipe that a thread of the session
    copies into the worker's CappedLog, so that the log stays capped whatever the process prints.

    The process's writes block while the pipe is full, so a slow copy slows the writer down and
    loses nothing. The copy ends when every writer has closed the pipe (the process and whatever
    it left running are gone), and all they wrote is in the log then: drain() waits for that.

    fifo: a path for a named pipe instead, for a process that another process starts (a worker
    forked by the local template): that one opens the path for writing, and once the worker holds
    it, handed_over() lets go of the session's own writing end and removes the path.
    """

    def __init__(self, log_path: str, fifo: str | None = None):
        import asyncio  # here: an SSH host's relay reads READ_CHUNK, and would pay 20 ms of its start

        loop = asyncio.get_running_loop()
        self.log = CappedLog(log_path)
        self.fifo = fifo
        self._ended = loop.create_future()
        self._lock = threading.Lock()
        opened: list[int] = []
        try:
            if fifo is None:
                self._read_fd, self.write_fd = os.pipe()
                opened += [self._read_fd, self.write_fd]
            else:
                os.mkfifo(fifo, 0o600)
                self._read_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                opened.append(self._read_fd)
                # Held until the worker holds its own: a FIFO that no one writes reads as ended.
                self.write_fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                opened.append(self.write_fd)
            self._wake_read, self._wake_write = os.pipe()
        except BaseException:
            for fd in opened:
                os.close(fd)
            self.log.close()
            if fifo is not None:
                with contextlib.suppress(OSError):
                    os.unlink(fifo)
            raise
        name = f"cmlcluster-output-{os.path.basename(log_path)}"
        threading.Thread(target=self._copy, args=(loop,), name=name, daemon=True).start()

    def handed_over(self) -> None:
        """The worker holds its own writing end now, or never will: the session lets go of its own."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        if self.fifo is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.fifo)
            self.fifo = None

    async def drain(self, timeout: float) -> None:
        """Once every writer is gone and all they wrote is in the log; at most `timeout` s, after which
        the copy stops (a process that outlived its worker, holding the pipe, writes here no more)."""
        import asyncio

        await asyncio.wait([self._ended], timeout=timeout)
        self.close()
        await asyncio.wait([self._ended], timeout=5)  # the thread lets go of the log and the pipe

    def close(self) -> None:
        """Stop copying: what is still in the pipe is dropped, and a writer left gets EPIPE. Idempotent."""
        self.handed_over()
        with self._lock:
            if self._wake_write >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_write, b"x")

    @property
    def ended(self) -> bool:
        """The copy has ended and let go of everything."""
        return self._ended.done()

    def _copy(self, loop: asyncio.AbstractEventLoop) -> None:
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        failed = False
        try:
            while True:
                if any(fd == self._wake_read for fd, _ in poller.poll()):
                    return
                try:
                    data = os.read(self._read_fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    return
                if not failed:
                    try:
                        self.log.write(data)
                    except OSError as e:  # a full disk, say: read on, so that the worker never blocks on it
                        failed = True
                        path = self.log.path
                        log.warning("cmlcluster: %s ends here (%s): what its worker writes next is lost", path, e)
        finally:
            self.log.close()
            os.close(self._read_fd)
            os.close(self._wake_read)
            with self._lock:
                os.close(self._wake_write)
                self._wake_write = -1
            with contextlib.suppress(RuntimeError):  # the session's loop is gone
                loop.call_soon_threadsafe(_settle, self._ended)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def drained(output: WorkerOutput | None, timeout: float) -> None:
    """output.drain(timeout); None (a handle made without a process, as tests do) has nothing to drain."""
    if output is not None:
        await output.drain(timeout)


async def start_process(log_path: str, *argv: str, **options: Any) -> tuple[asyncio.subprocess.Process, WorkerOutput]:
    """`argv` started (create_subprocess_exec's options) with its stdout and stderr into a WorkerOutput
    of `log_path`. Raises what create_subprocess_exec raises, leaving nothing of the output behind."""
    import asyncio

    output = WorkerOutput(log_path)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=output.write_fd, stderr=asyncio.subprocess.STDOUT, **options
        )
    except BaseException:
        output.close()
        raise
    finally:
        output.handed_over()
    return process, output
