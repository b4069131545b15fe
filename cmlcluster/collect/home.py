"""On the session's side: a worker's collect= files, written into the session's working folder (collect/paths.py).

A backend whose workers have folders of their own brings their files home between the worker's end
and its wait()/stop() returning, so a worker reported ended has its files here: the SSH backend takes
what the host kept (collect/on_host.py) over one more ssh command, the Docker backend copies them out of
the stopped container before removing it, and the session takes a pod's from its agent
(collect/through_agents.py). All hand a tar stream to `Homecoming.unpack`, the one place that decides
what of it is written. It trusts nothing the stream says (a worker's program, or whoever took its host,
wrote it):

- only files under the run's collect= paths (results.asked_for); anything else is dropped, and the
  warning names it. Of those, a .git or __pycache__ folder at any depth, and under "." the folder's
  hidden top-level entries (.ipython, .bashrc), only when a collect= path names them; left out, and said
  at INFO (an honest host or agent keeps none of them: results_host; a container's archive holds them);
- with `since` (a container's archive, which holds the files shipped to it too): only the files changed
  since the worker started, the others skipped without a word;
- only files: never a link, a device or anything outside the folder (no absolute names, no ".."), and
  never through a link: each folder on the way is opened without following one (O_NOFOLLOW), the
  user's own links included; a file whose way crosses one stays behind, named;
- each file to a temporary name beside its place, then renamed there (a reader never sees half a file),
  with the worker's modification time, its execute bits (never set-id or sticky bits, never writable by
  others);
- never over a file that was there before the workers' files came (the user's `train.py`, yesterday's
  `model.keras`), nor one made meanwhile: that one stays, and the worker's is written beside it as
  `<name>.<worker id>` (`.1`, `.2`, ... after it where that name is taken: nothing beside is replaced
  either), named in the warning; identical contents are kept once;
- keeps both when two workers of the session wrote one file with different contents: the later keeps
  the name and the earlier is renamed `<name>.<earlier worker's id>`; one warning names both workers;
- stops at the caps (results.cap_bytes, results.cap_files) and says so;
- never raises: a member that cannot be written (a name no folder holds, a time no clock holds) stays
  behind, named, and anything else unforeseen ends the stream there, said as "the rest".

The host's or agent's report (what stayed behind there) is a worker's word too: `checked_report` reads
what is not of its shape as empty, and says so. One warning per worker says all of what did not come as
sent. One worker's files at a time per session: two workers' files for one name meet in a known order.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import posixpath
import secrets
import shutil
import stat
import tarfile
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

from ..backends.base import Capabilities
from ..workers import WorkerSpec
from . import paths as results

log = logging.getLogger(__name__)

# Seconds for one worker's files to come home (1 GiB at 10 MB/s takes 100 s), after which what came stays.
BRING_TIMEOUT = 300.0
CHUNK = 1 << 20
NOTED = 20  # descriptions of what stayed behind, in a warning
ENTRIES_PER_FILE = 4  # a stream of more entries than this many per file allowed is read no further
# A long name's or PAX header's size: tarfile reads such a header whole into memory, whatever size it claims.
MAX_HEADER_BYTES = 64 << 10
FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
BESIDE = 100  # names tried beside a file that was here: <name>.<worker id>, then .1, .2, ...
LATEST = 2**62  # seconds either side of 1970 a file's time may be (time_t's range, and some)
REPORT_TEXT = 300  # characters of one name or message in a host's report that are read
# A host's or agent's report, by key: what each must be.
REPORT_NAMES = ("over_cap", "over_files_cap", "links", "errors", "missing")  # lists of texts
REPORT_COUNTS = ("over_cap_count", "over_files_cap_count", "links_count", "files", "bytes", "size")
REPORT_FLAGS = ("kept", "sent")


def brought_home(spec: WorkerSpec, capabilities: Capabilities) -> bool:
    """Whether a worker's collect= files must travel: its backend's workers do not see its cwd, where they
    would be already (local processes, a mounted folder, a shared volume)."""
    return bool(spec.collect) and not capabilities.sees(spec.cwd)


@dataclass
class Arrival:
    """What came home of one worker's files, and what did not. `collect`: the run's collect= paths, as
    the session has them (never as the stream says)."""

    worker_id: str
    dest: str
    collect: tuple[str, ...]
    files: int = 0
    bytes: int = 0
    conflicts: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # earlier worker -> [(name, saved)]
    behind: list[str] = field(default_factory=list)  # what stayed behind, described (the first NOTED)
    behind_count: int = 0
    stopped_at_cap: bool = False
    stopped_at_files_cap: bool = False
    not_asked: list[str] = field(default_factory=list)  # dropped: outside the collect= paths (the first few)
    not_asked_count: int = 0
    left_out: list[str] = field(default_factory=list)  # under a collect= path, but guarded (the first few)
    left_out_count: int = 0
    beside: list[tuple[str, str]] = field(default_factory=list)  # (a file that was here, the worker's beside it)

    def say(self, host_report: dict[str, Any] | None = None) -> None:
        """One line at INFO of what came; one WARNING for all that did not come as sent, and one per pair
        of workers whose files met."""
        report = checked_report(host_report or {}, self.worker_id)
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
        if self.behind_count > len(self.behind):
            behind.append(f"{self.behind_count - len(self.behind)} more")
        if report.get("over_cap_count") or self.stopped_at_cap:
            cap = results.size_text(results.cap_bytes())
            over = results.listing(report.get("over_cap", []), report.get("over_cap_count", 0)) or "the rest"
            behind.append(f"past the {cap} cap (CMLCLUSTER_COLLECT_CAP_MB): {over}")
        if report.get("over_files_cap_count") or self.stopped_at_files_cap:
            count = report.get("over_files_cap_count", 0)
            over = results.listing(report.get("over_files_cap", []), count) or "the rest"
            behind.append(f"past the {results.cap_files()}-file cap (CMLCLUSTER_COLLECT_CAP_FILES): {over}")
        if report.get("links_count"):
            links = results.listing(report.get("links", []), report["links_count"])
            behind.append(f"links, which are never followed out of a folder: {links}")
        behind += [f"an error on the host: {e}" for e in report.get("errors", [])]
        said = []
        if behind:
            said.append(f"these stayed behind and are gone with its folder: {'; '.join(behind)}")
        if self.not_asked_count:
            said.append(
                f"it sent {self.not_asked_count} file{'s' if self.not_asked_count != 1 else ''} that collect="
                f"{list(self.collect)!r} does not ask for, dropped: "
                f"{results.listing(self.not_asked, self.not_asked_count)}"
            )
        if self.beside:
            pairs = [f"{name} (the worker's is {saved})" for name, saved in self.beside]
            said.append(
                "these were here before and are kept as they were, the worker's written beside them (remove "
                f"the files before a run to have them replaced): {results.listing(pairs)}"
            )
        if said:
            log.warning(
                "cmlcluster: of worker %s's collect= files, %s came home to %s; %s",
                self.worker_id,
                what,
                self.dest,
                "; ".join(said),
            )
        if self.left_out_count:
            log.info(
                "cmlcluster: worker %s sent %d file%s that collect= brings only when named, left out: %s (.git and "
                '__pycache__ folders at any depth, and under "." hidden top-level entries: name one in '
                "collect= to have it)",
                self.worker_id,
                self.left_out_count,
                "s" if self.left_out_count != 1 else "",
                results.listing(self.left_out, self.left_out_count),
            )
        if report.get("missing"):
            log.info(
                "cmlcluster: worker %s had no %s in its working folder when it ended",
                self.worker_id,
                " or ".join(report["missing"]),
            )

    def stay(self, text: str) -> None:
        """One more that stayed behind: counted, and described among the first NOTED."""
        self.behind_count += 1
        if len(self.behind) < NOTED:
            self.behind.append(text)

    def drop(self, name: str) -> None:
        """A file outside every collect= path (a worker's end sends none honestly): dropped, warned of."""
        self.not_asked_count += 1
        if len(self.not_asked) < results.NAMED:
            self.not_asked.append(name)

    def leave(self, name: str) -> None:
        """A file under a collect= path that asks for it only by name (.git, __pycache__): left out."""
        self.left_out_count += 1
        if len(self.left_out) < results.NAMED:
            self.left_out.append(name)


def checked_report(raw: object, worker_id: str) -> dict[str, Any]:
    """A host's or agent's report (results_host.send's JSON line, agent_results.pack's answer) as the
    session reads it: each known key only where it is of its shape (lists of texts, counts, flags, "why"
    a text), texts cut short; what is not, read as empty, and one warning naming the worker says so."""
    if not isinstance(raw, dict):
        _misshapen(worker_id, [f"not a report: a {type(raw).__name__}"])
        return {}
    report: dict[str, Any] = {}
    wrong: list[str] = []
    for key, value in raw.items():
        if key in REPORT_NAMES:
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                report[key] = [v[:REPORT_TEXT] for v in value[:NOTED]]
            else:
                wrong.append(f"{key}: not a list of names")
        elif key in REPORT_COUNTS:
            if type(value) is int and value >= 0:
                report[key] = value
            else:
                wrong.append(f"{key}: not a count")
        elif key in REPORT_FLAGS:
            if isinstance(value, bool):
                report[key] = value
            else:
                wrong.append(f"{key}: not true or false")
        elif key == "why":
            report[key] = str(value)[:REPORT_TEXT]
    if wrong:
        _misshapen(worker_id, wrong)
    return report


def _misshapen(worker_id: str, wrong: list[str]) -> None:
    log.warning(
        "cmlcluster: worker %s's report on its collect= files is not as a host or agent writes it (%s); read as empty",
        worker_id,
        "; ".join(wrong),  # one per known key at most
    )


class _Behind(Exception):
    """A member that stays behind; the message says why."""


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
        """Write the files of a tar stream (its chunks) into arrival.dest (the session's working folder)
        that arrival.collect asks for; `rename` maps a member's name to its path there; `since`: only
        files changed since then (the worker's start, on its clock) count, for streams that hold them all
        (a container's). A stream that breaks off leaves the files before the break, each whole."""
        stream = _Chunks(chunks)
        with self._lock:
            try:
                if not stream.peek():
                    return  # nothing was sent
                self._members(stream, arrival, rename, since)
            except (tarfile.TarError, EOFError) as e:
                arrival.stay(f"the rest (the stream broke off: {e})")
            except Exception as e:  # whatever a stream holds, it ends here: the files before it stay
                log.debug("cmlcluster: worker %s's collect= files", arrival.worker_id, exc_info=True)
                arrival.stay(f"the rest ({type(e).__name__}: {e})")

    def _members(
        self, stream: _Chunks, arrival: Arrival, rename: Callable[[str], str] | None, since: float | None
    ) -> None:
        cap, cap_files = results.cap_bytes(), results.cap_files()
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo) as tar:  # type: ignore[call-overload]
            for entries, member in enumerate(tar, 1):
                if entries > cap_files * ENTRIES_PER_FILE:
                    arrival.stay(f"the rest (the stream held more than {entries - 1} entries)")
                    break
                name = rename(member.name) if rename else member.name
                parts = tuple(p for p in name.split("/") if p not in ("", "."))
                if member.isdir():
                    continue  # folders are made for the files in them
                if name.startswith("/") or ".." in parts or not parts:
                    arrival.stay(f"{member.name} (a name outside the folder)")
                elif since is not None and member.isreg() and not results.changed(member.mtime, since):
                    continue  # shipped to it, unchanged: not the worker's, whatever its name
                elif not results.asked_for(arrival.collect, "/".join(parts)):
                    if results.covers(arrival.collect, "/".join(parts)):
                        arrival.leave("/".join(parts))
                    else:
                        arrival.drop("/".join(parts))
                elif member.issym() or member.islnk():
                    arrival.stay(f"{name} (a link, never followed out of a folder)")
                elif not member.isreg():
                    arrival.stay(f"{name} (not a file)")
                elif member.size < 0:
                    arrival.stay(f"{name} (a size below 0)")
                elif arrival.bytes + member.size > cap:
                    arrival.stopped_at_cap = True
                    break
                elif arrival.files >= cap_files:
                    arrival.stopped_at_files_cap = True
                    break
                else:
                    self._file(tar, member, parts, arrival)

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: tuple[str, ...], arrival: Arrival) -> None:
        name = "/".join(parts)
        try:
            folder = _open_folder(arrival.dest, parts[:-1])
            try:
                written = self._write(tar, member, folder, parts[-1], name, arrival)
            finally:
                os.close(folder)
        except _Behind as e:
            arrival.stay(f"{name} ({e})")
            return
        except OSError as e:
            arrival.stay(f"{name} ({e.strerror or e})")
            return
        except (tarfile.TarError, EOFError):
            raise  # the stream itself broke off: the rest stays behind (unpack)
        except Exception as e:  # anything else this one member holds: it stays behind, the rest comes
            arrival.stay(f"{name} ({type(e).__name__}: {e})")
            return
        if written:
            arrival.files += 1
            arrival.bytes += member.size

    def _write(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, folder: int, base: str, name: str, arrival: Arrival
    ) -> bool:
        """The member's contents into `base` in the open `folder`; False when they were there already."""
        temporary = f".{base}.cmlcluster-{secrets.token_hex(4)}"
        source = tar.extractfile(member)
        assert source is not None
        try:
            fd = os.open(temporary, NEW_FILE, 0o600, dir_fd=folder)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(source, out, CHUNK)
                out.flush()
                # The worker's execute bits and read bits; never set-id or sticky bits, never writable by others.
                os.fchmod(fd, (member.mode & 0o755) | 0o600)
                if _a_time(member.mtime):  # else written now: a stream's time is a worker's word
                    with contextlib.suppress(OSError):
                        os.utime(fd, (member.mtime, member.mtime))
            return self._put(folder, temporary, base, name, arrival)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=folder)

    def _put(self, folder: int, temporary: str, base: str, name: str, arrival: Arrival) -> bool:
        """Put the arrived file in its place: over nothing, over the same worker's, or over an earlier
        worker's of this session (kept beside as <name>.<its id>). What was there before any worker's came,
        or was made or changed since (the user's), stays, the arrived file beside it; nothing beside is
        replaced either (_beside). False when the same contents were there already."""
        place, here = os.path.join(arrival.dest, name), _lstat(base, folder)
        if here is None and _link(folder, temporary, base):
            return self._brings(folder, base, place, arrival)
        here = here or _lstat(base, folder)  # made meanwhile: the user's
        earlier = self._brought.get(place)
        if here is not None and earlier is not None and (here.st_size, here.st_mtime_ns, here.st_ino) == earlier[1:]:
            if earlier[0] != arrival.worker_id and not _same(folder, base, temporary):
                saved = _beside(folder, base, base, earlier[0])  # a second name for it: the rename keeps that
                arrival.conflicts.setdefault(earlier[0], []).append((name, _sibling(name, saved)))
            os.replace(temporary, base, src_dir_fd=folder, dst_dir_fd=folder)
            return self._brings(folder, base, place, arrival)
        if here is not None and stat.S_ISREG(here.st_mode) and _same(folder, base, temporary):
            return False  # what the worker sent is here already
        target = _beside(folder, temporary, base, arrival.worker_id)
        arrival.beside.append((name, _sibling(name, target)))
        return self._brings(folder, target, os.path.join(os.path.dirname(place), target), arrival)

    def _brings(self, folder: int, base: str, place: str, arrival: Arrival) -> bool:
        """The file now at `place` (`base` in `folder`) is this worker's, as long as it stays as it is."""
        info = os.stat(base, dir_fd=folder, follow_symlinks=False)
        self._brought[place] = (arrival.worker_id, info.st_size, info.st_mtime_ns, info.st_ino)
        return True


def _link(folder: int, source: str, name: str) -> bool:
    """`source` given the name `name` too, in `folder`, unless something has that name (False): a hard
    link fails rather than replace. Where the file system has none, a look, then a rename."""
    try:
        os.link(source, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EXDEV):
            raise
        if _lstat(name, folder) is not None:
            return False
        os.rename(source, name, src_dir_fd=folder, dst_dir_fd=folder)
    return True


def _beside(folder: int, source: str, base: str, worker_id: str) -> str:
    """`source` linked in `folder` at the first free name of <base>.<worker id>, then .1, .2, ...; that name."""
    for n in range(BESIDE):
        name = f"{base}.{worker_id}" + (f".{n}" if n else "")
        if _link(folder, source, name):
            return name
    raise _Behind(f"{base}.{worker_id} and the {BESIDE - 1} names after it are all taken here")


def _sibling(name: str, base: str) -> str:
    """`base` in the folder of `name` (both relative to the session's folder)."""
    return posixpath.join(posixpath.dirname(name), base)


def _a_time(mtime: float) -> bool:
    """Whether a stream's modification time is one a file can have (finite, in time_t's range)."""
    return isinstance(mtime, (int, float)) and math.isfinite(mtime) and -LATEST < mtime < LATEST


def _open_folder(dest: str, parts: tuple[str, ...]) -> int:
    """The folder dest/parts..., opened; each part made if missing, and never through a link (the user's
    own included: one can lead out of the folder); _Behind when one is a link or not a folder."""
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _Behind(f"{dest}: {e.strerror or e}") from None
    for i, part in enumerate(parts):
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=fd)  # the umask's mode, as the user's own folders
            inner = os.open(part, FOLDER, dir_fd=fd)
        except OSError as e:
            info = _lstat(part, fd) if e.errno in (errno.ELOOP, errno.ENOTDIR) else None
            os.close(fd)
            way = "/".join(parts[: i + 1])
            if info is not None and stat.S_ISLNK(info.st_mode):
                raise _Behind(f"{way} is a link here, and nothing is written through one") from None
            if info is not None:
                raise _Behind(f"{way} is a file here, not a folder") from None
            raise _Behind(f"{way}: {e.strerror or e}") from None
        os.close(fd)
        fd = inner
    return fd


def _lstat(name: str, folder: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _same(folder: int, a: str, b: str) -> bool:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    with _reader(a, folder, flags) as fa, _reader(b, folder, flags) as fb:
        if os.fstat(fa.fileno()).st_size != os.fstat(fb.fileno()).st_size:
            return False
        while True:
            chunk = fa.read(CHUNK)
            if chunk != fb.read(CHUNK):
                return False
            if not chunk:
                return True


def _reader(name: str, folder: int, flags: int) -> IO[bytes]:
    return os.fdopen(os.open(name, flags, dir_fd=folder), "rb")


class _BoundedTarInfo(tarfile.TarInfo):
    """A member whose extended header (a long name, PAX records) claims more than MAX_HEADER_BYTES ends
    the stream before tarfile reads that header into memory."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        extended = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
        if self.type in (*extended, tarfile.SOLARIS_XHDTYPE) and self.size > MAX_HEADER_BYTES:
            raise tarfile.HeaderError(f"an extended header of {self.size} bytes (at most {MAX_HEADER_BYTES})")
        return super()._proc_member(tar)  # type: ignore[misc]


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
