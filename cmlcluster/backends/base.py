"""The backend contract: where a worker process starts, and nothing more.

Modelled on JupyterHub's Spawner. A backend starts, polls, waits for, stops and
reads the output of worker processes somewhere, with the resources asked for.
It knows nothing of ipyparallel, statuses or CML; the session does all that.

Lifecycle, all methods called from the session's event loop:

- ``attach(context)`` once per session, before its first ``start``. One backend object serves
  one open session at a time; after ``close()`` it may be attached to the next one.
- ``check(n, resources)`` before a launch, before ``attach`` and before anything
  has started: raise ConfigError if n such workers can never start here (say,
  more GPUs than exist).
- ``start(spec)`` returns a handle once the process has been created. It may
  raise BackendError; then nothing of that worker is left behind.
- ``poll(handle)`` returns None while the process is alive (and for a handle
  whose start has not returned yet there is no handle to poll), else its exit
  code; a process killed by signal N reports -N.
- ``wait(handle)`` returns the exit code once the process has ended.
- ``stop(handle, grace)`` ends the process: TERM, then KILL after ``grace``
  seconds. Idempotent: stopping a stopped worker is a no-op, never an error.
- ``output(handle)`` is the raw output of the process so far (the last part
  of it), for failure messages when the control plane saw nothing.
- ``close()`` once, after every worker has been stopped.
"""

from __future__ import annotations

import abc
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError
from ..workers import Resources, WorkerSpec

if TYPE_CHECKING:
    from ..control import ControlPlane


OUTPUT_TAIL_BYTES = 64 * 1024


def log_tail(path: str, limit: int = OUTPUT_TAIL_BYTES) -> str:
    """The last `limit` bytes of a worker's log file, as text ("" when there is none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class SessionContext:
    """What a backend learns about the session that owns it."""

    session_id: str
    session_dir: str


class Backend(abc.ABC):
    name: ClassVar[str]

    context: SessionContext
    _serving: str | None = None  # the id of the open session this backend serves

    def attach(self, context: SessionContext) -> None:
        if self._serving is not None:
            raise ConfigError(
                f"this {self.name} backend object already serves session {self._serving}, which is open; "
                "give each open session a backend of its own (or pass the backend's name)"
            )
        self._serving = context.session_id
        self.context = context

    def detach(self) -> None:
        """Called by the session after close(): the backend may serve another session now."""
        self._serving = None

    def controller_ip(self) -> str:
        """The address the session's controller listens on so that workers reach it."""
        return "127.0.0.1"

    def worker_python(self) -> str:
        """The Python interpreter's path inside workers (what a remote command should run)."""
        return sys.executable

    def worker_interfaces(self) -> tuple[str, ...]:
        """Network interfaces workers talk to each other on, for horovodrun/mpirun; () lets them find out."""
        return ()

    def control_plane(self) -> ControlPlane | None:
        """A control plane of the backend's own; None means the real ipyparallel one."""
        return None

    def check(self, n: int, resources: Resources) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError if n workers with these resources can never start here."""

    @abc.abstractmethod
    async def start(self, spec: WorkerSpec) -> Any: ...

    @abc.abstractmethod
    async def poll(self, handle: Any) -> int | None: ...

    @abc.abstractmethod
    async def wait(self, handle: Any) -> int: ...

    @abc.abstractmethod
    async def stop(self, handle: Any, grace: float = 5.0) -> None: ...

    @abc.abstractmethod
    def output(self, handle: Any) -> str: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend itself holds (networks, cgroups...)."""
