"""Which sessions run on this machine, for ``cmlcluster list`` and ``cmlcluster cleanup``.

Each session with workers keeps a small JSON record (no secrets: ids, statuses,
addresses, pids) in a folder private to the user, rewritten when a worker's status
changes and removed when the session closes. A record whose process is gone is
what a killed session left; cleanup ends what it lists and removes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ._proc import alive
from .events import Event, WorkerStatus

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger(__name__)


def folder() -> str:
    """Where the records are: CMLCLUSTER_STATE_DIR, else $XDG_RUNTIME_DIR/cmlcluster, else ~/.cache."""
    path = os.environ.get("CMLCLUSTER_STATE_DIR") or (
        os.path.join(os.environ["XDG_RUNTIME_DIR"], "cmlcluster")
        if os.environ.get("XDG_RUNTIME_DIR")
        else os.path.join(os.path.expanduser("~"), ".cache", "cmlcluster", "sessions")
    )
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class Recorder:
    """Keeps `session`'s record up to date (a subscriber: it never slows the session)."""

    def __init__(self, session: Session):
        self.session = session
        self.path = os.path.join(folder(), f"{session.id}.json")
        self._workers: dict[str, dict[str, Any]] = {}
        self._started = time.time()
        self._lock = threading.Lock()  # a write in flight never recreates the record after close()
        self._closed = False
        self._write()
        self._unsubscribe = session.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if not isinstance(event, WorkerStatus):
            return
        w = event.worker
        with self._lock:
            if self._closed:
                return
            self._workers[w["id"]] = {k: w.get(k) for k in ("id", "status", "ip_address", "hostname", "exit_code")}
            self._workers[w["id"]]["pid"] = self.session.worker_pid(w["id"])
            try:
                self._write()
            except OSError as e:
                log.warning("cmlcluster: could not update %s (cmlcluster list will not show it): %s", self.path, e)

    def _write(self) -> None:
        record = {
            "id": self.session.id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "backend": self.session.backend.name,
            "started": self._started,
            "session_dir": self.session.session_dir,
            "workers": list(self._workers.values()),
        }
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(record, f)
        os.replace(temporary, self.path)  # readers never see half a record

    def close(self) -> None:
        self._unsubscribe()
        with self._lock:
            self._closed = True
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


def records() -> list[dict[str, Any]]:
    """Every record here, each with "alive": whether its session's process still runs."""
    found = []
    for name in sorted(os.listdir(folder())):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder(), name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced, or not ours
        record["alive"] = record.get("host") == socket.gethostname() and alive(int(record.get("pid", 0)))
        found.append(record)
    return found


def clean(record: dict[str, Any], dry_run: bool = False) -> list[str]:
    """End what a dead session of this machine left (its worker processes, its folder); says what it did."""
    if record.get("alive") or record.get("host") != socket.gethostname():
        return []  # a live session's, or another machine's (a shared home folder): not ours to end
    done = []
    session_id = str(record["id"])
    for worker in record.get("workers", []):
        pid = worker.get("pid")
        if pid and _is_worker_of(pid, session_id):
            done.append(f"worker {worker['id']} (pid {pid})")
            if not dry_run:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # local workers lead their process group
    session_dir = record.get("session_dir")
    # Only the session's own folder (cmlcluster-<id>-...), whatever else a record may say.
    if session_dir and os.path.basename(session_dir).startswith(f"cmlcluster-{session_id}-"):
        if os.path.isdir(session_dir):
            done.append(f"folder {session_dir}")
            if not dry_run:
                shutil.rmtree(session_dir, ignore_errors=True)
    if not dry_run:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder(), f"{record['id']}.json"))
    return done


def _is_worker_of(pid: int, session_id: str) -> bool:
    """Whether pid is still a worker of that session (not a process that got its pid since)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"cmlcluster.agent" not in f.read():
                return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"CDSW_MASTER_ID={session_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False
