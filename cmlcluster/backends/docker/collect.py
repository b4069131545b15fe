"""How the Docker backend brings a worker's collect= files home (collect/paths.py), before it reports its end.

A container whose files are to come home is made without --rm (collect.home decides, at create); its wait
thread, once it has stopped, copies each path out of it (the engine's archive API, which reads a stopped
container's files) and then removes it. Its exit is reported after that.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import posixpath
import re
import time
from typing import TYPE_CHECKING, Any

from ...collect.home import BRING_TIMEOUT, Arrival, Homecoming, brought_home
from ...workers import WorkerSpec
from . import worker as docker_worker

if TYPE_CHECKING:
    from ..base import Capabilities, SessionContext

log = logging.getLogger(__name__)

START_POLL = 0.05  # seconds between looks at a container that has not started yet


def keeps_container(spec: WorkerSpec, capabilities: Capabilities) -> bool:
    """Whether the worker's container stays after its exit (no --rm), for its files to come home."""
    return brought_home(spec, capabilities)


def wait_then_bring_home(container: Any, spec: WorkerSpec | None, context: SessionContext) -> dict[str, Any]:
    """On the container's wait thread: Docker's answer once the container is gone. One kept for its files
    is waited for until it stops, its files are brought home, and it is removed."""
    if spec is None or not _kept(container):
        return dict(container.wait(condition="removed", timeout=None))
    while True:
        answer = dict(container.wait(condition="not-running", timeout=None))
        container.reload()
        if container.status in ("exited", "dead"):
            break
        # Not started yet, Docker answers "not running" at once (and then it may be running already).
        time.sleep(START_POLL if container.status == "created" else 0)
    try:
        _from_container(Homecoming.of(context), container, spec)
    except Exception as e:
        log.warning("cmlcluster: could not bring worker %s's collect= files home: %s", spec.worker_id, e)
    finally:
        container.remove(force=True)
    return answer


def _from_container(home: Homecoming, container: Any, spec: WorkerSpec) -> None:
    import docker.errors

    since = _started(container.attrs.get("State", {}).get("StartedAt", ""))
    work = docker_worker.work_folder(spec)
    arrival, missing = Arrival(spec.worker_id, spec.cwd, spec.collect), []
    deadline = time.monotonic() + BRING_TIMEOUT
    for path in spec.collect:
        try:
            chunks, _ = container.get_archive(posixpath.normpath(posixpath.join(work, path)))
        except docker.errors.NotFound:
            missing.append(path)
            continue
        # The archive names its top by its base name ("run1/..." for "results/run1"): as the path, then.
        home.unpack(_until(chunks, deadline), arrival, rename=functools.partial(_under, path), since=since)
        if arrival.stopped_at_cap or arrival.stopped_at_files_cap:
            break
    arrival.say({"missing": missing})


def _under(path: str, name: str) -> str:
    return posixpath.join(path, name.partition("/")[2])


def _until(chunks: Any, deadline: float) -> Any:
    for chunk in chunks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the copy took more than {BRING_TIMEOUT:g} s")
        yield chunk


def _started(text: str) -> float | None:
    """Docker's StartedAt ("2026-11-25T04:15:03.251062474Z", the engine's clock) as a time.time()."""
    found = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?", text)
    if found is None:
        return None
    fraction = float(found.group(2) or 0)
    return dt.datetime.fromisoformat(found.group(1)).replace(tzinfo=dt.timezone.utc).timestamp() + fraction


def _kept(container: Any) -> bool:
    """Whether the container was made to stay after its exit (as Docker has it), for its files."""
    return not container.attrs.get("HostConfig", {}).get("AutoRemove", True)


def end_container(container: Any) -> None:
    """A container past its stop's grace: killed and removed; one kept for its files only killed (its wait
    thread brings them home, then removes it); one never started (nothing in it yet) removed."""
    if not _kept(container):
        container.remove(force=True)
        return
    try:
        container.kill()
    except Exception:  # not running: stopped already (its wait thread has it), or never started
        container.reload()
        if container.status == "created":
            container.remove(force=True)


def removal_wait(container: Any) -> float:
    """How long a stop waits for a killed container to be gone: its files' journey home included."""
    return BRING_TIMEOUT + 10 if _kept(container) else 10
