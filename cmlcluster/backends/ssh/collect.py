"""How the SSH backend brings a worker's collect= files home (collect/paths.py), before it reports its end.

The host kept the files aside as the worker's folder went (collect.on_host.keep); once the ssh connection
has ended, one more ssh command (collect.on_host's `send`) streams them here and removes them there. A host
that does not answer keeps them: a warning says where, and for how long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...collect import paths as results
from ...collect.home import BRING_TIMEOUT, Arrival, Homecoming, brought_home, checked_report
from ...collect.on_host import KEEP_DAYS
from ...workers import WorkerSpec

if TYPE_CHECKING:
    from ..base import Capabilities, SessionContext

log = logging.getLogger(__name__)

HOST_MODULE = "cmlcluster.collect.on_host"


async def over_ssh(
    spec: WorkerSpec | None,
    capabilities: Capabilities,
    context: SessionContext,
    host: str,
    python_on_host: Callable[..., list[str]],
) -> None:
    """Once the worker's ssh connection has ended: its kept files, from `host` into spec.cwd.
    python_on_host(*args): the argv that runs the host's Python with `args` over ssh."""
    if spec is None or not brought_home(spec, capabilities):
        return
    home = Homecoming.of(context)
    caps = (str(results.cap_bytes()), str(results.cap_files()))
    argv = python_on_host("-m", HOST_MODULE, "send", spec.worker_id, *caps)
    await home.once(spec.worker_id, lambda: asyncio.to_thread(_fetch, home, argv, spec, host))


def _fetch(home: Homecoming, argv: list[str], spec: WorkerSpec, host: str) -> None:
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    said: list[bytes] = []
    reader = threading.Thread(target=lambda: said.append(process.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    timer = threading.Timer(BRING_TIMEOUT, process.kill)
    timer.start()
    arrival = Arrival(spec.worker_id, spec.cwd, spec.collect)
    try:
        home.unpack(iter(lambda: process.stdout.read(1 << 20), b""), arrival)  # type: ignore[union-attr]
    finally:
        process.stdout.close()
        code = process.wait()
        timer.cancel()
        reader.join(5)
    text = b"".join(said).decode(errors="replace")
    found = next((_json(line) for line in reversed(text.splitlines()) if line.startswith("{")), None)
    report = None if found is None else checked_report(found, spec.worker_id)  # the host's word: its shape checked
    if report is not None and report.get("kept") and report.get("sent", True):
        arrival.say(report)
        return
    if report is not None and not report.get("kept"):
        why = f"the host kept none: {report.get('why', 'nothing was kept')}"
        log.warning("cmlcluster: worker %s's collect= files did not come home (%s)", spec.worker_id, why)
        return
    why = f"no answer within {BRING_TIMEOUT:g} s" if code == -9 else (text.strip().splitlines() or [f"exit {code}"])[-1]
    if arrival.files:
        arrival.say()  # what came before the break
    log.warning(
        "cmlcluster: could not bring worker %s's collect= files home from %s (%s); they stay there for %g days, "
        "in cmlcluster-results-<uid>/%s under its temp folder",
        spec.worker_id,
        host,
        why,
        KEEP_DAYS,
        spec.worker_id,
    )


def _json(line: str) -> dict[str, Any] | None:
    try:
        found = json.loads(line)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
