"""What the panel shows, as JSON-ready dicts: read from the sessions' records and kept logs, never from a
kernel, so it holds every notebook's and terminal's sessions and outlives kernels and page reloads.

- live sessions: each record on this machine (records.py) with its state (alive, gone, answering,
  elsewhere), notebook, backend, and workers with their status, host and latest resource sample;
- kept sessions: those whose workers' logs are kept (worker_logs.py) and whose record is gone, with their
  notebook, outcome and duration (session_summary.py);
- a worker log's tail, read only from the kept-logs folder;
- stop (through the session's own endpoint: stop_socket.py) and cleanup (what `cmlcluster cleanup` does).

Blocking (files, a controller probe of up to a second): the handlers call these on a thread.
"""

from __future__ import annotations

import os
import re
import stat
import time
from typing import Any

from .. import origin, records, session_summary, stop_socket, worker_logs
from ..errors import ConfigError
from ..ui.model import resource_texts
from ..worker_env import worker_label

SESSION_ID = re.compile(r"[0-9a-f]{16}")  # session.py's token_hex(8)
LOG_BYTES = 64 << 10  # a log view's default: what a screen of lines needs
MAX_LOG_BYTES = 1 << 20


class NotFound(ConfigError):
    """What was asked for is not there (a session gone meanwhile, a log never written): HTTP 404."""


def snapshot(root_dir: str = "") -> dict[str, Any]:
    """Every session the panel shows; notebooks under `root_dir` (the Jupyter server's) by their path there."""
    now = time.time()
    live = [_live(record, root_dir) for record in records.records()]
    recorded = {s["id"] for s in live}
    kept = []
    try:
        found = worker_logs.kept_sessions(worker_logs.folder())
    except (OSError, ConfigError):
        found = []  # no kept logs (a read-only home, CMLCLUSTER_KEEP_LOGS=0 from the start): nothing to list
    for k in found:
        if k.session_id in recorded:
            continue  # its record says it runs, or was left by a session that died: listed above
        kept.append(_kept(k, root_dir))
    return {"now": now, "live": live, "kept": kept}


def _notebook(path: str, root_dir: str) -> dict[str, str | None]:
    """The notebook as shown ("name") and as JupyterLab opens it ("path", relative to its root; None
    outside it, or for a script or a terminal)."""
    if root_dir and os.path.isabs(path) and path.startswith(os.path.join(root_dir, "")):
        relative = os.path.relpath(path, root_dir)
        return {"name": relative, "path": relative if relative.endswith(".ipynb") else None}
    return {"name": path or "?", "path": None}


def label(worker: dict[str, Any]) -> str:
    """The worker's label as the session's widget shows it: its job's ("ps 0", kept by the record), else
    "w3" for "<session>-3"."""
    return worker_label(str(worker.get("id")), worker.get("label"))


def _live(record: dict[str, Any], root_dir: str) -> dict[str, Any]:
    state = record["state"]
    control = str(record.get("control") or "")
    return {
        "id": record["id"],
        "state": state,
        "notebook": _notebook(str(record.get("notebook") or ""), root_dir),
        "backend": record.get("backend"),
        "started": record.get("started"),
        "pid": record.get("pid"),
        "can_stop": state == origin.ALIVE and bool(control),
        "logs_kept": bool(record.get("logs_kept", True)),  # False: CMLCLUSTER_KEEP_LOGS=0, no log to show
        "workers": [
            {
                "id": w.get("id"),
                "label": label(w),
                "status": w.get("status"),
                "host": w.get("hostname") or w.get("ip_address") or "",
                "exit_code": w.get("exit_code"),
                "usage": w.get("usage"),  # the latest resource sample (ResourceUse.fields), or None
                # What it asked for and uses, in the widget's words (ui/model.py): "0.5 · 38 %", ...
                **dict(zip(("cpu_text", "memory_text", "gpu_text"), resource_texts(w), strict=True)),
            }
            for w in record.get("workers", [])
        ],
    }


def _kept(kept: worker_logs.Kept, root_dir: str) -> dict[str, Any]:
    summary = kept.summary or {}
    state = kept.state(running=set())
    started, ended = summary.get("started"), summary.get("ended")
    statuses = {str(w.get("id")): w for w in summary.get("workers", []) if isinstance(w, dict)}
    ids = list(dict.fromkeys([*statuses, *kept.workers]))
    return {
        "id": kept.session_id,
        "state": state,  # closed, died (no "ended": its process went without closing), unknown (no summary)
        "notebook": _notebook(str(summary.get("notebook") or ""), root_dir),
        "backend": summary.get("backend"),
        "started": started,
        "ended": ended,
        "last_seen": kept.newest,  # its newest log write: when a session that died was last seen
        "outcome": session_summary.describe(summary.get("outcome") or {}) if summary else "unknown",
        "size": kept.size,
        "workers": [
            {
                "id": i,
                "label": label({"id": i, **statuses.get(i, {})}),
                "status": statuses.get(i, {}).get("status"),
                "exit_code": statuses.get(i, {}).get("exit_code"),
                "log": i in kept.workers,
            }
            for i in ids
        ],
    }


def log_tail(session_id: str, worker_id: str, limit: int = LOG_BYTES) -> dict[str, Any]:
    """The last `limit` bytes (at most MAX_LOG_BYTES) of a worker's log in the kept-logs folder.

    Only `<logs>/<session id>/<session id>-<n>.log`: ids are checked against their forms before they
    touch a path, and neither the session's folder nor the log may be a symbolic link (O_NOFOLLOW), so
    no request reads a file elsewhere; nor anything but a regular file (a FIFO would hold the thread).
    A live session that keeps no logs (CMLCLUSTER_KEEP_LOGS=0) is NotFound, saying so."""
    if not SESSION_ID.fullmatch(session_id):
        raise ConfigError(f"session {session_id!r}: a session id is 16 hex digits")
    if not re.fullmatch(rf"{session_id}-\d+", worker_id):
        raise ConfigError(f"worker {worker_id!r}: a worker of session {session_id} is {session_id}-<number>")
    if not 0 < limit <= MAX_LOG_BYTES:
        raise ConfigError(f"bytes={limit}: give 1 to {MAX_LOG_BYTES}")
    root = worker_logs.folder()
    try:
        folder = os.open(os.path.join(root, session_id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise NotFound(_no_kept_logs(session_id, root)) from e
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer; it is refused below instead.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(f"{worker_id}.log", flags, dir_fd=folder)
    except OSError as e:
        raise NotFound(f"no log of worker {worker_id} in session {session_id}'s kept logs") from e
    finally:
        os.close(folder)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotFound(f"{worker_id}.log in session {session_id}'s kept logs is not a regular file: not read")
    with open(fd, "rb") as f:
        size = info.st_size
        f.seek(max(0, size - limit))
        data = f.read(limit)
    if size > limit:  # begin at a line: the first one is cut
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else data
    return {
        "session": session_id,
        "worker": worker_id,
        "size": size,
        "truncated": size > limit,
        "text": data.decode(errors="replace"),
    }


def _no_kept_logs(session_id: str, root: str) -> str:
    """Why a session has no kept logs: a live one that keeps none (CMLCLUSTER_KEEP_LOGS=0) says so."""
    record = next((r for r in records.records() if r["id"] == session_id), None)
    if record is not None and not record.get("logs_kept", True):
        return (
            f"session {session_id} keeps no logs after it ends (it was started with {worker_logs.KEEP_ENV}=0): "
            "its workers' logs stay in its own folder and go with it, so the panel cannot show them. "
            f"Unset {worker_logs.KEEP_ENV} before the session starts to see them here"
        )
    return f"session {session_id} kept no logs in {root}"


def stop(session_id: str, worker_ids: list[str] | None) -> list[str]:
    """Stop these workers of a live session of this machine (None: all), through its own endpoint; the
    ids being stopped. NotFound for a session that is not live here; ConfigError with the session's refusal."""
    record = next((r for r in records.records() if r["id"] == session_id), None)
    if record is None or record["state"] != origin.ALIVE:
        raise NotFound(f"no live session {session_id!r} on this machine")
    path = str(record.get("control") or "")
    session_dir = str(record.get("session_dir") or "")
    # Only the socket in the session's own folder (cmlcluster-<id>-...), whatever else a record may say.
    if (
        not path
        or os.path.dirname(path) != session_dir
        or not os.path.basename(session_dir).startswith(f"cmlcluster-{session_id}-")
        or os.path.basename(path) != stop_socket.SOCKET_NAME
    ):
        raise NotFound(f"session {session_id} serves no stop endpoint (an older cmlcluster, or not Linux)")
    try:
        return stop_socket.request(path, worker_ids)
    except OSError as e:
        raise NotFound(f"session {session_id} did not answer at {path}: {e}") from e


def cleanup() -> list[str]:
    """What `cmlcluster cleanup` ends, for the sessions whose process is gone: their workers, folders and
    records, and their backends' leftovers (containers, pods); what was ended, one line each."""
    return records.clean_gone(records.records()) + [f"ended {what}" for what in records.backend_leftovers()]
