"""Workers' logs, kept after their session: `cmlcluster logs SESSION [WORKER]` reads them once the
session is closed, crashed, or went with a kernel that died.

Every backend writes a worker's log (a logfile.CappedLog: its first 1 MiB and its last 4 to 8 MiB)
straight into `<logs>/<session id>/<worker id>.log` rather than into the session's folder: nothing
has to be copied at close, so a SIGKILLed session leaves its logs as complete as they were. `<logs>`
is $CMLCLUSTER_STATE_DIR/logs, else $XDG_STATE_HOME/cmlcluster/logs, else ~/.local/state/cmlcluster/logs:
on a disk, not in the runtime folder (a tmpfs) where session records live, since a log is read after a
reboot too. Its folders are the user's alone (0700) and its files 0600: a folder that others may write is
refused like the records' folder; one that others may only read (an older cmlcluster's 0755) is made 0700,
and that is said once.

CMLCLUSTER_KEEP_LOGS=0 keeps nothing: the workers' logs then go into the session's own folder, which goes
when the session ends (its controller's lifeline removes it even after a kill -9), so the session still
shows and quotes them while it runs. `cmlcluster logs --delete SESSION` (or `--all`) removes kept logs.

Beside the logs, `session.json` (session_summary.py) says which notebook the session ran in and how its
workers ended; `cmlcluster logs` lists the sessions by these.

Retention, applied when a session makes its folder (its first launch), oldest first: at most
KEEP_SESSIONS sessions, none whose newest file is older than KEEP_DAYS, KEEP_BYTES in all. Only
folders named like a session id go, and never one whose session's record says it still runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import origin, records, session_summary
from .errors import ConfigError

log = logging.getLogger(__name__)

KEEP_SESSIONS = 50
KEEP_DAYS = 14
KEEP_BYTES = 2 << 30  # 2 GiB
_SESSION_ID = re.compile(r"[0-9a-f]{16}")  # session.py's token_hex(8): nothing else in the folder is removed
KEEP_ENV = "CMLCLUSTER_KEEP_LOGS"
# What became of a kept session (Kept.state).
RUNNING, CLOSED, DIED, UNKNOWN = "running", "closed", "died", "unknown"


def keep() -> bool:
    """Whether workers' logs are kept after their session: not when CMLCLUSTER_KEEP_LOGS is 0 (or false, no, off)."""
    return os.environ.get(KEEP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def folder() -> str:
    """The folder of every session's worker logs (made, and checked private: made 0700 when others may read it)."""
    base = os.environ.get("CMLCLUSTER_STATE_DIR")
    if base:
        path = os.path.join(base, "logs")
    else:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        path = os.path.join(state, "cmlcluster", "logs")
    os.makedirs(path, mode=0o700, exist_ok=True)
    # Its parent too: whoever may write there could put a folder of theirs in its place.
    for checked in (os.path.dirname(path), path):
        records.check_private(checked, "worker logs")
    _make_private(path)
    return path


def _make_private(path: str) -> None:
    """Take the read and search bits of others off a folder of the user's own (checked by check_private):
    an older cmlcluster, or a umask of 022 on a folder made by hand, left the logs readable by every user."""
    if not hasattr(os, "geteuid"):
        return
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        os.chmod(path, 0o700)
        log.warning(
            "cmlcluster: the worker logs folder %s was readable by other users (mode %#o); it is 0700 now", path, mode
        )


def session_folder(session_id: str) -> str:
    """The folder of this session's worker logs, made; older sessions' past the retention rules go first.
    "" when it cannot be made (a read-only home), or when CMLCLUSTER_KEEP_LOGS=0: the logs then stay in the
    session's folder, and go with it."""
    if not keep():
        log.info("cmlcluster: %s=0: the workers' logs go with the session's folder when it ends", KEEP_ENV)
        return ""
    try:
        root = folder()
        path = os.path.join(root, session_id)
        os.makedirs(path, mode=0o700, exist_ok=True)
        _make_private(path)
    except OSError as e:
        log.warning("cmlcluster: worker logs are not kept after this session: %s", e)
        return ""
    try:
        prune(root, keep={session_id})
    except (OSError, ConfigError) as e:  # the records unreadable: prune nothing rather than a live session's
        log.warning("cmlcluster: older sessions' worker logs in %s were not pruned: %s", root, e)
    return path


@dataclass
class Kept:
    """One session's kept logs."""

    session_id: str
    path: str
    newest: float = 0.0  # the newest modification time of the folder and its files
    size: int = 0
    workers: list[str] = field(default_factory=list)  # worker ids, in launch order
    summary: dict[str, Any] | None = None  # its session.json (session_summary.py); None for an older session's

    def log(self, worker_id: str) -> str:
        return os.path.join(self.path, f"{worker_id}.log")

    def state(self, running: set[str]) -> str:
        """RUNNING (its session's record says it may still run: `running`, from running_sessions()),
        CLOSED (its session closed: the summary says when), DIED (its process ended without closing: a
        killed kernel), or UNKNOWN (no summary: an older cmlcluster's)."""
        if self.session_id in running:
            return RUNNING
        if self.summary is None:
            return UNKNOWN
        return CLOSED if self.summary.get("ended") else DIED


def kept_sessions(root: str) -> list[Kept]:
    """The sessions with a folder in `root`, newest first."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            if not (_SESSION_ID.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            try:  # another session's pruning, or a log rolling, may remove what was listed
                kept = Kept(entry.name, entry.path, newest=entry.stat(follow_symlinks=False).st_mtime)
                with os.scandir(entry.path) as files:
                    for file in files:
                        with contextlib.suppress(FileNotFoundError):
                            info = file.stat(follow_symlinks=False)
                            kept.newest, kept.size = max(kept.newest, info.st_mtime), kept.size + info.st_size
                            if file.name.endswith(".log") and file.is_file(follow_symlinks=False):
                                kept.workers.append(file.name.removesuffix(".log"))
            except FileNotFoundError:
                continue
            kept.workers.sort(key=_launch_order)
            kept.summary = session_summary.read(entry.path)
            found.append(kept)
    return sorted(found, key=lambda k: k.newest, reverse=True)


def _launch_order(worker_id: str) -> tuple[int, str]:
    number = worker_id.rpartition("-")[2]
    return (int(number) if number.isdigit() else -1, worker_id)


def prune(
    root: str,
    keep: Iterable[str] = (),
    *,
    now: float | None = None,
    sessions: int = KEEP_SESSIONS,
    days: float = KEEP_DAYS,
    max_bytes: int = KEEP_BYTES,
    running: Callable[[], set[str]] | None = None,
) -> list[str]:
    """Remove the sessions' folders past the retention rules, oldest first; the ids removed.

    keep: sessions never removed (the one starting); running(): the ids of sessions that still run
    (default: those whose record is not gone), asked only when something is to go.
    """
    now = time.time() if now is None else now
    found = kept_sessions(root)  # newest first
    total = sum(k.size for k in found)
    old = {k.session_id for k in found if now - k.newest > days * 86400}
    if len(found) <= sessions and total <= max_bytes and not old:
        return []
    spared = set(keep) | (running or running_sessions)()
    doomed = {k.session_id for i, k in enumerate(found) if i >= sessions or k.session_id in old} - spared
    total -= sum(k.size for k in found if k.session_id in doomed)
    for k in reversed(found):  # then the oldest, until the rest fits
        if total <= max_bytes:
            break
        if k.session_id not in doomed | spared:
            doomed.add(k.session_id)
            total -= k.size
    removed = [k for k in reversed(found) if k.session_id in doomed]  # oldest first
    for k in removed:
        shutil.rmtree(k.path, ignore_errors=True)
    return [k.session_id for k in removed]


def running_sessions() -> set[str]:
    """Sessions whose record says they may still run (this machine's, another's, or one that answers)."""
    return {str(r["id"]) for r in records.records() if r["state"] != origin.GONE}


# ---------------------------------------------------------------- `cmlcluster logs`


def show(session: str | None, worker: str | None = None, tail: int | None = None) -> int:
    """`cmlcluster logs`: the kept sessions; or a session's worker logs (one worker's), their last `tail` lines."""
    root = folder()
    found = kept_sessions(root)
    if session is None:
        return _list(root, found)
    kept = _find(found, session, root)
    names = kept.workers
    if worker is not None:
        names = [w for w in kept.workers if w in (worker, f"{kept.session_id}-{worker}")]
        if not names:
            known = ", ".join(kept.workers) or "none"
            raise ConfigError(f"session {kept.session_id} kept no log of worker {worker!r}; its workers: {known}")
    if not names:
        print(f"session {kept.session_id} kept no worker logs (in {kept.path})")
    for i, name in enumerate(names):
        if len(names) > 1:
            print(f"{'' if i == 0 else chr(10)}==> {name} <==")
        sys.stdout.write(_read(kept.log(name), tail))
    sys.stdout.flush()
    return 0


def delete(session: str | None, everything: bool = False, running: Callable[[], set[str]] | None = None) -> int:
    """`cmlcluster logs --delete`: remove the kept logs of `session` (an id, or the start of one), or with
    `everything` those of every session kept; never those of a session that still runs (its record says
    so), nor a folder that is not the user's own."""
    if (session is None) == (not everything):
        raise ConfigError("logs --delete: give a SESSION, or --all")
    root = folder()
    found = kept_sessions(root)
    chosen = found if everything else [_find(found, session or "", root)]
    live = (running or running_sessions)()
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for kept in chosen:
        if kept.session_id in live:
            if not everything:
                raise ConfigError(f"session {kept.session_id} still runs: close it, then delete its logs")
            print(f"session {kept.session_id}: left (it still runs)")
            continue
        owner = os.stat(kept.path, follow_symlinks=False).st_uid
        if uid is not None and owner != uid:
            print(f"session {kept.session_id}: left ({kept.path} belongs to uid {owner}, not to you)")
            continue
        shutil.rmtree(kept.path)
        print(f"session {kept.session_id}: deleted its worker logs ({_size(kept.size)})")
    if not chosen:
        print(f"no worker logs kept in {root}")
    return 0


def _find(found: list[Kept], session: str, root: str) -> Kept:
    """The session of this id or of the one id this begins."""
    matches = [k for k in found if k.session_id == session] or [k for k in found if k.session_id.startswith(session)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ConfigError(f"{session!r} begins {len(matches)} sessions' ids: give more of it")
    raise ConfigError(
        f"no worker logs of session {session!r} in {root}: `cmlcluster logs` lists the sessions kept (the last "
        f"{KEEP_SESSIONS}, at most {KEEP_DAYS} days old)"
    )


def _read(path: str, tail: int | None) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return f"[cmlcluster: cannot read {path}: {e}]\n"
    if tail is not None:
        data = b"".join(data.splitlines(keepends=True)[-tail:] if tail > 0 else [])
    text = data.decode(errors="replace")
    return text if not text or text.endswith("\n") else text + "\n"


def _list(root: str, found: list[Kept]) -> int:
    if not found:
        print(f"no worker logs kept in {root}")
        return 0
    print(f"worker logs in {root} (newest first; `cmlcluster logs SESSION [WORKER]` shows them):")
    running = running_sessions()
    rows = [("session", "notebook", "started", "duration", "outcome", "workers", "size")]
    for k in found:
        summary = k.summary or {}
        started = summary.get("started")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(started or k.newest))
        took, outcome = _outcome(k, k.state(running), now=time.time())
        notebook = _short_path(str(summary.get("notebook") or "?"))
        rows.append((k.session_id, notebook, when, took, outcome, str(len(k.workers)), _size(k.size)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _outcome(kept: Kept, state: str, now: float) -> tuple[str, str]:
    """(duration, outcome) of a kept session, as `cmlcluster logs` lists them."""
    summary = kept.summary or {}
    started, ended = summary.get("started"), summary.get("ended")
    counts = session_summary.describe(summary.get("outcome") or {})
    if state == RUNNING:
        return session_summary.duration(now - started) if started else "?", f"running: {counts}"
    if state == CLOSED:
        return session_summary.duration(ended - started) if started else "?", counts
    if state == DIED:  # its last log write is the latest it was seen alive
        return f"~{session_summary.duration(kept.newest - started)}" if started else "?", f"died ({counts})"
    return "?", "unknown (an older cmlcluster's session)"


def _short_path(path: str) -> str:
    """A notebook's path as a person reads it: relative to here when below it, ~ for the home folder."""
    if not os.path.isabs(path):
        return path
    here = os.getcwd()
    if path.startswith(here + os.sep):
        return os.path.relpath(path, here)
    home = os.path.expanduser("~")
    return "~" + path[len(home) :] if home != os.sep and path.startswith(home + os.sep) else path


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
