"""Which sessions run on this machine, for ``cmlcluster list`` and ``cmlcluster cleanup``.

Each session with workers keeps a small JSON record (no secrets: ids, statuses,
addresses, pids, where its process runs and where its controller listens) in a folder
private to the user, rewritten when a worker's status changes and removed when the
session closes. A record whose session is gone (origin.py says when: this machine's and
this PID namespace's, its process ended, its controller silent) is what a killed session
left; cleanup ends what it lists and removes it. Records of other machines or PID
namespaces (a shared home folder, a devcontainer) are listed and left alone.

The folder is refused unless it is the user's own and only the user may write to it:
cleanup kills the pids a record names, so a record others could write would be theirs to aim.

The record keeper also keeps the session's summary beside its workers' logs (session_summary.py: its
notebook and how its workers ended, for `cmlcluster logs` and the JupyterLab panel once it is over), and
serves the session's stop endpoint (stop_socket.py: how the panel stops its workers), whose path the
record names under "control".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from . import origin, session_summary, stop_socket
from .errors import ConfigError
from .events import Event, JobChanged, JobState, ResourceUse, WorkerStatus
from .viewers import ViewedSession
from .worker_env import worker_label
from .workers import TERMINAL

log = logging.getLogger(__name__)


class RecordedSession(ViewedSession, Protocol):
    """What a record reads of its session (Session is one): what its views see, its folders and where its
    workers run. The session, above, makes the Recorder."""

    @property
    def session_dir(self) -> str | None: ...

    @property
    def log_folder(self) -> str | None: ...

    @property
    def controller_address(self) -> str: ...

    def on_close(self, callback: Callable[[], None]) -> None: ...

    def list_workers(self) -> list[dict[str, Any]]: ...

    def worker_pid(self, worker: str | Mapping[str, Any]) -> int | None: ...


# A worker's fields a record keeps: where it runs and how it ended, what it asked for (`list --watch`
# shows it beside what it uses), and its name (launch_workers(name=...)).
RECORDED = ("id", "status", "ip_address", "hostname", "exit_code", "cpu", "memory", "nvidia_gpu", "name")
# A record is rewritten for resource samples at most every USAGE_WRITE_SECONDS, and at most once a second per
# USAGE_WRITE_WORKERS workers: each write is every worker's record (at 1,024 workers, once a second took 7 % of
# a core of the notebook's process while the views drew: bench/printing_model.py).
USAGE_WRITE_SECONDS = 1.0
USAGE_WRITE_WORKERS = 256


def folder() -> str:
    """Where the records are: CMLCLUSTER_STATE_DIR, else $XDG_RUNTIME_DIR/cmlcluster, else ~/.cache."""
    path = os.environ.get("CMLCLUSTER_STATE_DIR") or (
        os.path.join(os.environ["XDG_RUNTIME_DIR"], "cmlcluster")
        if os.environ.get("XDG_RUNTIME_DIR")
        else os.path.join(os.path.expanduser("~"), ".cache", "cmlcluster", "sessions")
    )
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private(path)
    return path


def check_private(path: str, what: str = "session records") -> None:
    """Refuse (ConfigError, naming the fix) a folder that is not the user's own or that others may write."""
    if not hasattr(os, "geteuid"):
        return  # Windows: no owner and mode bits of this kind
    info = os.stat(path)
    uid = os.geteuid()
    if info.st_uid != uid:
        raise ConfigError(
            f"the state folder {path} belongs to uid {info.st_uid}, not to you (uid {uid}): cmlcluster will "
            f"not read or write {what} there. Make it yours (`chown {uid} {shlex.quote(path)}`) "
            "or set CMLCLUSTER_STATE_DIR to a folder of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"the state folder {path} is writable by others (mode {stat.S_IMODE(info.st_mode):#o}): cmlcluster "
            f"will not read or write {what} there. Fix: `chmod 700 {shlex.quote(path)}`"
        )


class Recorder:
    """Keeps `session`'s record up to date (a subscriber: it never slows the session)."""

    def __init__(self, session: RecordedSession):
        self.session = session
        self.path = os.path.join(folder(), f"{session.id}.json")
        self._workers: dict[str, dict[str, Any]] = {}
        self._labels: dict[str, str] = {}  # worker id -> its job's name for it ("ps 0"), as the views say
        self._started = time.time()
        self._lock = threading.Lock()  # a write in flight never recreates the record after close()
        self._closed = False
        self._written = 0.0  # when the record was last written (monotonic)
        self._dirty = self._summary_dirty = False  # changed since the last write (of the record, the summary)
        self._notebook = session_summary.notebook()
        self._endpoint = self._serve_stops()
        self._write()
        self._write_summary()
        self._unsubscribe = session.subscribe(self._on_event, after_batch=self._flush)

    def _serve_stops(self) -> stop_socket.StopEndpoint | None:
        """The session's stop endpoint, in its folder; closed as the session begins to close (before its
        workers stop), so that no request reaches a session that is going. None where none can be served."""
        if not self.session.session_dir:
            return None
        try:
            path = os.path.join(self.session.session_dir, stop_socket.SOCKET_NAME)
            served = stop_socket.StopEndpoint(path, self.stop)
        except OSError as e:
            log.info("cmlcluster: no stop endpoint for the JupyterLab panel (its Stop will not show): %s", e)
            return None
        self.session.on_close(served.close)
        return served

    def stop(self, ids: list[str] | None) -> list[str]:
        """Begin stopping these workers of the session (None: all of them), as the session's own Stop does;
        the ids of those that had not ended. ConfigError naming an id that is no worker of the session."""
        workers = {w["id"]: w for w in self.session.list_workers()}
        chosen = list(workers) if ids is None else ids
        unknown = [i for i in chosen if i not in workers]
        if unknown:
            raise ConfigError(f"no worker {', '.join(map(repr, unknown))} in session {self.session.id}")
        going = [i for i in dict.fromkeys(chosen) if workers[i]["status"] not in TERMINAL]
        if going:
            self.session.stop_workers_soon(*going)
        return going

    def _on_event(self, event: Event) -> None:
        """Each change in memory; _flush() writes them, once for all the events delivered together (a launch
        of 1,024 workers is thousands of changes: a write of every worker's record each was quadratic)."""
        with self._lock:
            if self._closed:
                return
            if isinstance(event, WorkerStatus):
                w = event.worker
                record = w.to_dict()  # the record file holds CML's dicts, as `cmlcluster list` shows them
                kept = {k: record.get(k) for k in RECORDED}
                kept["label"] = worker_label(w.id, self._labels.get(w.id))
                kept["pid"] = self.session.worker_pid(w.id)
                kept["usage"] = self._workers.get(w.id, {}).get("usage")
                self._workers[w.id] = kept
                self._dirty = self._summary_dirty = True
            elif isinstance(event, JobChanged) and event.state in (JobState.STARTED, JobState.MEMBER_REPLACED):
                for member in event.members:
                    self._labels[member.worker_id] = worker_label(
                        member.worker_id, role=member.role, index=member.index
                    )
                    if member.worker_id in self._workers:
                        self._workers[member.worker_id]["label"] = self._labels[member.worker_id]
                self._dirty = True
            elif isinstance(event, ResourceUse) and event.worker_id in self._workers:
                self._workers[event.worker_id]["usage"] = event.fields()
                # Samples come from every worker: at most one write a second for them, less often for many.
                every = USAGE_WRITE_SECONDS * max(1.0, len(self._workers) / USAGE_WRITE_WORKERS)
                self._dirty |= time.monotonic() - self._written >= every

    def _flush(self) -> None:
        with self._lock:
            if self._closed or not self._dirty:
                return
            self._dirty = False
            try:
                self._write()
            except OSError as e:
                log.warning("cmlcluster: could not update %s (cmlcluster list will not show it): %s", self.path, e)
            if self._summary_dirty:
                self._summary_dirty = False
                self._write_summary()

    def _write(self) -> None:
        here = origin.this_process()
        record = {
            "id": self.session.id,
            "pid": here.pid,
            "host": here.host,
            "origin": here.as_strings(),
            "controller": self.session.controller_address,  # cleanup asks it before ending anything
            "backend": self.session.backend.name,
            "started": self._started,
            "session_dir": self.session.session_dir,
            "notebook": self._notebook,
            "control": self._endpoint.path if self._endpoint is not None else "",  # stop_socket.py
            "logs_kept": self._logs_kept(),  # False: its logs go with its folder (the panel shows none)
            "workers": list(self._workers.values()),
        }
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump(record, f)
        os.replace(temporary, self.path)  # readers never see half a record
        self._written = time.monotonic()

    def _write_summary(self, workers: list[dict[str, Any]] | None = None, ended: float | None = None) -> None:
        """The session's summary beside its workers' logs (session_summary.py); `ended` at close only."""
        logs = self.session.log_folder
        if not logs or not self._logs_kept():
            return  # no logs, or logs that go with the session's folder (CMLCLUSTER_KEEP_LOGS=0): nothing kept
        # Its label too: once it is kept, the panel names a worker as it did while it ran ("ps 0", not "w3").
        kept = [
            {
                **{k: w.get(k) for k in ("id", "status", "exit_code", "hostname")},
                "label": worker_label(str(w["id"]), self._labels.get(str(w["id"]))),
            }
            for w in (self._workers.values() if workers is None else workers)
        ]
        summary = {
            "id": self.session.id,
            "notebook": self._notebook,
            "backend": self.session.backend.name,
            "started": self._started,
            "ended": ended,
            "outcome": session_summary.outcome(kept),
            "workers": kept,
        }
        try:
            session_summary.write(logs, summary)
        except OSError as e:
            log.warning("cmlcluster: could not write the summary of session %s in %s: %s", self.session.id, logs, e)

    def _logs_kept(self) -> bool:
        """Whether the workers' logs outlive the session: not when they are in its own folder
        (CMLCLUSTER_KEEP_LOGS=0, or a logs folder that could not be made)."""
        logs, own = self.session.log_folder, self.session.session_dir
        return not (logs and own and logs.startswith(os.path.join(own, "")))

    def close(self) -> None:
        """At the session's close, after its workers ended: its record goes, its summary says how it ended."""
        self._unsubscribe()
        if self._endpoint is not None:
            self._endpoint.close()
        with self._lock:
            self._closed = True
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            self._write_summary(self.session.list_workers(), ended=time.time())


def records(*, probe: bool = True) -> list[dict[str, Any]]:
    """Every record here, each with "state": origin.ALIVE, GONE, ANSWERING or ELSEWHERE.

    probe=False: a session whose process is gone is not told apart by asking its controller (a TCP
    connection, up to a second each): for callers that want only the ALIVE ones, on a server's loop."""
    found = []
    path = folder()
    for name in sorted(os.listdir(path)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(path, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced, or not ours
        if not isinstance(record, dict) or "id" not in record:
            continue
        written = record.get("origin")
        where = origin.Origin.from_strings(written) if isinstance(written, dict) else None
        record["state"] = origin.state(where, str(record.get("controller") or "") if probe else None)
        found.append(record)
    return found


def clean(record: dict[str, Any], dry_run: bool = False) -> list[str]:
    """End what a gone session left (its worker processes, its folder); says what it did."""
    if record.get("state") != origin.GONE:
        return []  # alive, answering, or another machine's or PID namespace's: not ours to end
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


def clean_gone(found: list[dict[str, Any]], dry_run: bool = False) -> list[str]:
    """clean() each gone session of `found` (records()): one line each, saying what was (or would be) ended.
    What `cmlcluster cleanup` prints and the panel's cleanup answers."""
    verb = "would end" if dry_run else "ended"
    return [
        f"session {r['id']} (pid {r.get('pid')} is gone): {verb} {', '.join(clean(r, dry_run)) or 'nothing'}"
        for r in found
        if r.get("state") == origin.GONE
    ]


def backend_leftovers(
    dry_run: bool = False, options: dict[str, Any] | None = None, warn: Callable[[str], object] = log.warning
) -> list[str]:
    """What each registered backend that has something to look at here ended for sessions that are gone
    (containers, pods): the rest of what `cmlcluster cleanup` does. A backend with nothing here (no engine,
    no cluster configured, no client installed) is skipped; one that fails is told to `warn`, and the rest go on."""
    from .backends import backend_class, known_backends

    done: list[str] = []
    for name in known_backends():
        try:
            done += backend_class(name).cleanup(dry_run, dict(options or {}))
        except ConfigError:
            continue
        except Exception as e:  # configured, but it did not answer: say so, clean the rest
            warn(f"the {name} backend was not checked: {e}")
    return done
