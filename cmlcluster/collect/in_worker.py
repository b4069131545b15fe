"""In a worker: its collect= files (collect/paths.py), handed to the session through the control plane.

Where the backend cannot reach a worker's folder once the worker has ended (a pod's: the Kubernetes API
reads no files of a stopped container), the session takes them from the worker's agent before it stops
the worker: once its program has ended, or been interrupted by the stop (collect/through_agents.py).
`pack` moves them aside as an SSH host keeps them (results_host.keep: changed files only, links left
behind) and writes them, capped, as one tar file beside (results_host.send); `chunk` reads it piece by
piece, one call's reply each, so that neither side ever holds more than a piece; `drop` removes it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any

from ..agent import files as agent_files
from . import on_host as results_host


def pack(worker_id: str, cap: int, cap_files: int | None = None) -> dict[str, Any]:
    """Keep this worker's collect= files and write them into one tar file; the host's report (what came,
    what stayed behind) with the file's "size". {"kept": False, "why": ...} when there is nothing to keep."""
    folder, collect = agent_files.own_folder, agent_files.collected
    if not folder or not collect:
        return {"kept": False, "why": "the worker's working folder is not its own, or it has no collect= paths"}
    results_host.keep(folder, worker_id, collect, agent_files.started)
    said = io.StringIO()
    with open(_packed(worker_id), "wb") as out:
        results_host.send(worker_id, cap, out, said, cap_files)
    lines = [line for line in said.getvalue().splitlines() if line.startswith("{")]
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {"kept": False, "why": said.getvalue().strip()}
    report["size"] = os.path.getsize(_packed(worker_id))
    return report


def chunk(worker_id: str, offset: int, size: int) -> bytes:
    """`size` bytes of the packed files from `offset` (fewer at the end)."""
    with open(_packed(worker_id), "rb") as f:
        f.seek(offset)
        return f.read(size)


def drop(worker_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_packed(worker_id))
    with contextlib.suppress(OSError):
        os.rmdir(results_host.results_root())  # the last one out


def _packed(worker_id: str) -> str:
    if not results_host.WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"not a worker id: {worker_id!r}")
    return os.path.join(results_host.own_root(make=True), f"{worker_id}.tar")
