"""What a session was, kept beside its workers' logs (worker_logs.py): its notebook, backend, when it
started and ended, and how its workers ended. `cmlcluster logs` and the JupyterLab panel name a kept
session by these, not only by its hex id.

`session.json` in the session's log folder (0600, like the logs), written by the session's record keeper
(records.Recorder) at its first launch, at each change of a worker's status, and at close, which adds
"ended". A session whose process died (a killed kernel) leaves it as it last was: its workers' last known
statuses and no "ended", which is how a reader tells "closed" from "died".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

FILE = "session.json"
MAX_BYTES = 1 << 20  # a summary is a few hundred bytes a worker; anything larger is not one of ours
# How a session's workers ended, in the order a summary names them.
ORDER = ("succeeded", "failed", "stopped", "running", "scheduling")


def notebook() -> str:
    """What this session runs in: the notebook's path (Jupyter Server 2 sets JPY_SESSION_NAME in the
    kernels it starts, as ipykernel's `__session__`), else the script's path, "python -c", a Jupyter
    kernel whose notebook is unknown (an older server, nbclient), or "terminal" (an interactive Python)."""
    named = os.environ.get("JPY_SESSION_NAME", "").strip()
    if named:
        return named
    program = sys.argv[0] if sys.argv else ""
    if program in ("", "-"):
        return "terminal"
    if program == "-c":
        return "python -c"
    if os.path.basename(program).startswith("ipykernel_launcher"):
        return "a Jupyter kernel"
    return os.path.abspath(program)


def outcome(workers: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many workers are in each status: {"succeeded": 2, "stopped": 1}, in ORDER."""
    counts: dict[str, int] = {}
    for worker in workers:
        status = str(worker.get("status"))
        counts[status] = counts.get(status, 0) + 1
    known = {status: counts.pop(status) for status in ORDER if status in counts}
    return {**known, **dict(sorted(counts.items()))}


def describe(counts: Mapping[str, int]) -> str:
    """ "2 succeeded, 1 stopped"; "no workers" for none."""
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or "no workers"


def duration(seconds: float) -> str:
    """ "45 s", "3 min 20 s", "2 h 05 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def write(folder: str, summary: Mapping[str, Any]) -> None:
    """`summary` as folder/session.json, whole or not at all (readers never see half of it), 0600."""
    path = os.path.join(folder, FILE)
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "w") as f:
            json.dump(summary, f)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read(folder: str) -> dict[str, Any] | None:
    """folder/session.json; None when there is none (a session of an older cmlcluster) or it is unreadable."""
    try:
        fd = os.open(os.path.join(folder, FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        summary = json.loads(data) if len(data) <= MAX_BYTES else None
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None
