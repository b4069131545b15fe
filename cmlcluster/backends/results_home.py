"""On the session's side: a worker's collect= files, written into the session's working folder (results.py).

A backend whose workers have folders of their own brings their files home between the worker's end
and its wait()/stop() returning, so a worker reported ended has its files here: the SSH backend takes
what the host kept (results_host.py) over one more ssh command, the Docker backend copies them out of
the stopped container before removing it. Both hand a tar stream to `Homecoming.unpack`, which:

- writes each file to a temporary name beside its place, then renames it there (a reader never sees
  half a file), with the worker's modification time;
- writes only files: never a link, a device or anything outside the folder (no absolute names, no
  "..") and never through a link it made; links the worker made stay behind, and a warning names them;
- keeps both when two workers of the session wrote one file with different contents: the later keeps
  the name and the earlier is renamed `<name>.<earlier worker's id>`; one warning names both workers;
- stops at the cap (results.cap_bytes) and says so.

One worker's files at a time per session: two workers' files for one name meet in a known order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import tarfile
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import results

log = logging.getLogger(__name__)

CHUNK = 1 << 20


@dataclass
class Arrival:
    """What came home of one worker's files, and what did not."""

    worker_id: str
    dest: str
    files: int = 0
    bytes: int = 0
    conflicts: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # earlier worker -> [(name, saved)]
    behind: list[str] = field(default_factory=list)  # what stayed behind, described
    stopped_at_cap: bool = False

    def say(self, host_report: dict[str, Any] | None = None) -> None:
        """One line at INFO of what came; a WARNING for what did not, and one per pair of workers whose
        files met."""
        report = host_report or {}
        what = f"{self.files} file{'s' if self.files != 1 else ''}, {results.size_text(self.bytes)}"
        if self.files:
            log.info("cmlcluster: worker %s's collect= files came home to %s (%s)", self.worker_id, self.dest, what)
        for earlier, names in self.conflicts.items():
            pairs = [f"{name} (worker {earlier}'s now {saved})" for name, saved in names]
            log.warning(
                "cmlcluster: workers %s and %s both wrote %s with different contents; the later one's (%s) keep "
                "the names, the earlier one's are kept beside them: %s",
                earlier,
                self.worker_id,
                results.listing([n for n, _ in names]),
                self.worker_id,
                results.listing(pairs),
            )
        behind = list(self.behind)
        if report.get("over_cap_count") or self.stopped_at_cap:
            cap = results.size_text(results.cap_bytes())
            over = results.listing(report.get("over_cap", []), report.get("over_cap_count", 0)) or "the rest"
            behind.append(f"past the {cap} cap (CMLCLUSTER_COLLECT_CAP_MB): {over}")
        if report.get("links_count"):
            links = results.listing(report["links"], report["links_count"])
            behind.append(f"links, which are never followed out of a folder: {links}")
        behind += [f"an error on the host: {e}" for e in report.get("errors", [])]
        if behind:
            log.warning(
                "cmlcluster: of worker %s's collect= files, %s came home to %s; these stayed behind and are gone "
                "with its folder: %s",
                self.worker_id,
                what,
                self.dest,
                "; ".join(behind),
            )
        if report.get("missing"):
            log.info(
                "cmlcluster: worker %s had no %s in its working folder when it ended",
                self.worker_id,
                " or ".join(report["missing"]),
            )


class Homecoming:
    """One session's arrivals: who brought each file (two workers' same file), one worker's at a time."""

    _sessions: ClassVar[weakref.WeakKeyDictionary[Any, Homecoming]] = weakref.WeakKeyDictionary()
    _sessions_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # a file's path -> (worker id, size, mtime_ns, inode) of the file that worker wrote there
        self._brought: dict[str, tuple[str, int, int, int]] = {}
        self._bringing: dict[str, asyncio.Future[None]] = {}

    @classmethod
    def of(cls, context: Any) -> Homecoming:
        """The Homecoming of the session `context` (a backend's SessionContext) serves; gone with it."""
        with cls._sessions_lock:
            return cls._sessions.setdefault(context, cls())

    async def once(self, worker_id: str, bring: Callable[[], Awaitable[None]]) -> None:
        """Run bring() once per worker; wait() and stop() both ask, and both return once it is done. A
        caller cancelled meanwhile (a session's teardown) does not cancel it for the other."""
        if worker_id not in self._bringing:
            self._bringing[worker_id] = asyncio.ensure_future(bring())
        await asyncio.shield(self._bringing[worker_id])

    def unpack(
        self,
        chunks: Iterable[bytes],
        arrival: Arrival,
        *,
        rename: Callable[[str], str] | None = None,
        since: float | None = None,
    ) -> None:
        """Write the files of a tar stream (its chunks) into arrival.dest (the session's working folder);
        `rename` maps a member's name to its path there; `since`: only files changed since then (the
        worker's start, on its clock) count, for streams that hold them all (a container's). A stream
        that breaks off leaves the files before the break, each whole."""
        stream = _Chunks(chunks)
        if not stream.peek():
            return  # nothing was sent
        with self._lock:
            try:
                self._members(stream, arrival, rename, since)
            except (tarfile.TarError, EOFError) as e:
                arrival.behind.append(f"the rest (the stream broke off: {e})")

    def _members(
        self, stream: _Chunks, arrival: Arrival, rename: Callable[[str], str] | None, since: float | None
    ) -> None:
        cap = results.cap_bytes()
        with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                name = rename(member.name) if rename else member.name
                parts = tuple(p for p in name.split("/") if p not in ("", "."))
                if member.isdir():
                    continue  # folders are made for the files in them
                if name.startswith("/") or ".." in parts or not parts:
                    arrival.behind.append(f"{member.name} (a name outside the folder)")
                elif member.issym() or member.islnk():
                    arrival.behind.append(f"{name} (a link, never followed out of a folder)")
                elif not member.isreg():
                    arrival.behind.append(f"{name} (not a file)")
                elif since is not None and not results.changed(member.mtime, since):
                    continue  # shipped to it, unchanged
                elif arrival.bytes + member.size > cap:
                    arrival.stopped_at_cap = True
                    break
                else:
                    self._file(tar, member, parts, arrival)

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: tuple[str, ...], arrival: Arrival) -> None:
        name = "/".join(parts)
        folder = os.path.join(arrival.dest, *parts[:-1])
        place = os.path.join(folder, parts[-1])
        try:
            os.makedirs(folder, exist_ok=True)  # through the user's own links in their folder, as a shared disk
            if os.path.isdir(place) and not os.path.islink(place):
                raise IsADirectoryError(f"{place} is a folder here")
        except OSError as e:
            arrival.behind.append(f"{name} ({e.strerror or e})")
            return
        temporary = os.path.join(folder, f".{parts[-1]}.cmlcluster-{secrets.token_hex(4)}")
        source = tar.extractfile(member)
        assert source is not None
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(source, out, CHUNK)
                os.fchmod(fd, (member.mode & 0o755) | 0o600)  # no set-id bits, no writing by others
            os.utime(temporary, (member.mtime, member.mtime), follow_symlinks=False)
            self._put(temporary, place, name, arrival)
        except OSError as e:
            arrival.behind.append(f"{name} ({e.strerror or e})")
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        arrival.files += 1
        arrival.bytes += member.size

    def _put(self, temporary: str, place: str, name: str, arrival: Arrival) -> None:
        """Rename the arrived file into its place; an earlier worker's different file there is kept beside."""
        earlier = self._brought.get(place)
        if earlier is not None and earlier[0] != arrival.worker_id:
            with contextlib.suppress(FileNotFoundError):
                now = os.lstat(place)
                # Still what the earlier worker brought (not a file the user changed since), and not the same.
                if (now.st_size, now.st_mtime_ns, now.st_ino) == earlier[1:] and not _same(place, temporary):
                    saved = f"{place}.{earlier[0]}"
                    os.replace(place, saved)
                    arrival.conflicts.setdefault(earlier[0], []).append((name, f"{name}.{earlier[0]}"))
        os.replace(temporary, place)
        info = os.lstat(place)
        self._brought[place] = (arrival.worker_id, info.st_size, info.st_mtime_ns, info.st_ino)


def _same(a: str, b: str) -> bool:
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            chunk = fa.read(CHUNK)
            if chunk != fb.read(CHUNK):
                return False
            if not chunk:
                return True


class _Chunks:
    """A file to read from an iterable of byte chunks (a pipe's reads, Docker's archive stream)."""

    def __init__(self, chunks: Iterable[bytes]):
        self._chunks = iter(chunks)
        self._buffer = b""

    def peek(self) -> bytes:
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._buffer = chunk
        return self._buffer

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            out, self._buffer = self._buffer + b"".join(self._chunks), b""
            return out
        if not self.peek():
            return b""
        out, self._buffer = self._buffer[:size], self._buffer[size:]
        return out
