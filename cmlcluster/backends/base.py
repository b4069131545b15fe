"""The backend contract: where a worker process starts, and nothing more.

Modelled on JupyterHub's Spawner. A backend starts, polls, waits for, stops and
reads the output of worker processes somewhere, with the resources asked for.
It knows nothing of ipyparallel, statuses or CML; the session does all that.

Lifecycle, all methods called from the session's event loop. A method that may block (on a
network, an engine, an API server) is async, and runs its blocking client on a thread, so that
the loop that carries every worker's events never waits on one backend:

- ``attach(context)`` once per session, before its first ``start``. One backend object serves
  one open session at a time; after ``close()`` it may be attached to the next one.
- ``check(n, resources)`` before a launch, before ``attach`` and before anything
  has started: raise ConfigError if n such workers can never start here (say,
  more GPUs than exist).
- ``prepare_launch(specs)`` before the workers of one launch start: a scheduler may
  place them as one (Slurm's gang job); most backends do nothing. BackendError fails
  the launch's workers, with nothing of them left.
- ``start(spec)`` returns a handle once the process has been created. It may
  raise BackendError; then nothing of that worker is left behind.
- ``poll(handle)`` returns None while the process is alive (and for a handle
  whose start has not returned yet there is no handle to poll), else its exit
  code; a process killed by signal N reports -N.
- ``wait(handle)`` returns the exit code once the process has ended *and* its
  output has been read to its end: what it wrote last (a stopped program's
  cleanup, say) is in ``output(handle)`` before the session hears of its end.
  Where it declares ``collects``, what the worker wrote under ``spec.collect`` is
  in ``spec.cwd`` by then too (collect/paths.py), success, failure or stop alike.
  A backend waits for the end of the stream its output arrives through (a
  container's or a pod's log, the pipe of a process: logfile.WorkerOutput), at
  most OUTPUT_DRAIN_SECONDS after the exit. The log it copies the stream into is
  a logfile.CappedLog at ``context.log_path(worker id)``: its first part and a rolling tail,
  never more, in a folder kept after the session (``cmlcluster logs``).
- ``stop(handle, grace)`` ends the process: TERM, then KILL after ``grace``
  seconds, and returns once it has ended, its output read as for ``wait``.
  Idempotent: stopping a stopped worker is a no-op, never an error.
- ``output(handle)`` is the raw output of the process so far (the last part
  of it), for failure messages when the control plane saw nothing.
- ``exit_reason(handle)`` may say why a process ended when its exit code alone
  does not (its host stopped answering, say); ``exit_status(handle)`` how, where
  a scheduler ended it (a job cancelled from outside is "stopped").
- ``waiting_reason(handle)`` may say why a started worker does not run yet (a
  scheduler's queue), for the messages of workers still starting.
- ``close()`` once, after every worker has been stopped.

And one class method, outside any session: ``cleanup(dry_run, options)`` ends what sessions of
this host whose process is gone left with this backend (``cmlcluster cleanup`` calls it on every
registered backend).

A backend also *declares* what its workers are (``capabilities()``), so that the
core never branches on a backend's name and never assumes a worker shares the
session's host. Everything a worker needs from the session reaches it as data in
its WorkerSpec (the controller's connection info included); what it runs
reaches it over the control plane (scripts and folders travel as archives when
``sees()`` says the worker cannot read them where they are).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from ..errors import ConfigError
from ..logfile import read_tail
from ..wire import DEFAULT_SILENCE_TIMEOUT
from ..workers import Resources, Status, WorkerSpec

if TYPE_CHECKING:
    from ..control.plane import ControlPlane


OUTPUT_TAIL_BYTES = 64 * 1024
# How long an ended worker's exit waits for the rest of its output stream (a container's or a pod's
# log, copied by a thread of the backend's): bounded, so that a stuck stream cannot hide an end.
OUTPUT_DRAIN_SECONDS = 5.0

# A CI job or a test run sets CMLCLUSTER_RUN_TAG to find what its sessions started: every container
# a backend makes carries it as the label cmlcluster.run-tag.
RUN_TAG_ENV = "CMLCLUSTER_RUN_TAG"
RUN_TAG_LABEL = "cmlcluster.run-tag"


def run_tag_labels() -> dict[str, str]:
    """{RUN_TAG_LABEL: tag} when the session's process has a run tag, else {}."""
    tag = os.environ.get(RUN_TAG_ENV, "")
    return {RUN_TAG_LABEL: tag} if tag else {}


def signal_exit_code(code: int) -> int:
    """The contract's exit code: a process that a shell, docker-init or a container runtime reports
    as 128+N died of signal N, which the contract says as -N."""
    return 128 - code if 128 < code <= 128 + 64 else code


def log_tail(path: str, limit: int = OUTPUT_TAIL_BYTES) -> str:
    """The last `limit` bytes of a worker's log file (a CappedLog), as text ("" when there is none yet)."""
    return read_tail(path, limit)


@dataclass(frozen=True)
class Capabilities:
    """What a backend's workers are. The core reads this; it never guesses from a backend's name.

    own_address: each worker has an IP of its own (containers, pods), so fixed ports such as
        sshd's 2222 never clash; else workers share their host's address and need distinct ports.
    session_host: workers run on the session's own machine, as the session's user, and start with
        the session's environment. Otherwise they receive only the variables the user passed
        (env=) plus cmlcluster's own: the notebook's environment may hold credentials.
    python: the interpreter a command on a worker should run.
    shared_paths: folders of the session's machine that workers see at the same path ("/" for
        all); anything else a program needs is shipped to them.
    interfaces: the network interfaces workers talk to each other on, for horovodrun and mpirun;
        () lets the frameworks find out, except run_horovod on hosts it reaches over sshd: it names
        the interface each host's worker reports (horovodrun's own probe puts its key on command lines).
    stable_addresses: a worker launched to replace a lost one has the lost one's address, as
        TensorFlow needs to take a lost task back (local: every worker is this host's).
    silence_timeout: the session's silence_timeout when the user gives none: seconds of silence on
        the control plane before a worker is taken as lost (its agent ends it; a session that died
        leaves workers running that long). Sized for a real network; short where nothing but this
        host lies between the session and its workers.
    session_machine: workers run on the session's machine, as its processes or in containers of an
        engine there: every user of the machine can connect to what they listen on (docs/security.md).
    collects: what a worker wrote under its spec's collect= paths (collect/paths.py) is in the session's
        spec.cwd once wait() or stop() returns, also where the worker's folder is its own and the
        worker was killed outright. Else, where workers do not see the session's working folder, the
        session takes the files through the worker's agent before it stops it
        (collect/through_agents.py), which a worker killed outright takes with it.
    """

    own_address: bool
    session_host: bool
    python: str
    shared_paths: tuple[str, ...]
    interfaces: tuple[str, ...] = ()
    stable_addresses: bool = False
    silence_timeout: float = DEFAULT_SILENCE_TIMEOUT
    collects: bool = False
    session_machine: bool = False

    def sees(self, path: str) -> bool:
        """Whether workers read `path` (absolute, on the session's machine) at the same path."""
        path = os.path.abspath(path)
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.shared_paths)


@dataclass(frozen=True)
class SessionContext:
    """What a backend learns about the session that owns it."""

    session_id: str
    session_dir: str
    silence_timeout: float = DEFAULT_SILENCE_TIMEOUT  # the session's (see Capabilities.silence_timeout)
    # Where the workers' logs go: a folder kept after the session (worker_logs.py); "": the session's own.
    logs: str = ""

    def log_path(self, worker_id: str) -> str:
        """Where a backend writes worker `worker_id`'s log (best a logfile.CappedLog); its folder exists."""
        folder = self.logs or os.path.join(self.session_dir, "workers")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return os.path.join(folder, f"{worker_id}.log")


HandleT = TypeVar("HandleT")


class Backend(abc.ABC, Generic[HandleT]):
    """Where worker processes run (the contract is this module's docstring, and docs/guide/writing-a-backend.md).

    Typed by its handle: what identifies one started process to the backend (a process, a
    container, a pod). The session keeps each worker's handle and gives it back, untouched.
    """

    name: ClassVar[str]

    context: SessionContext
    _serving: str | None = None  # the id of the open session this backend serves

    async def attach(self, context: SessionContext) -> None:
        """Once per session, before its first start: connect, prepare (networks, logins), and
        raise ConfigError if this backend cannot serve here. Subclasses call this first."""
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

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend's workers are (see Capabilities); read at each launch."""

    def control_plane(self) -> ControlPlane | None:
        """A control plane of the backend's own; None means the real ipyparallel one."""
        return None

    async def check(self, n: int, resources: Resources) -> None:
        """Raise ConfigError if n workers with these resources can never start here: before each
        launch, before anything of it starts (the first launch's comes before attach)."""

    async def prepare_launch(self, specs: Sequence[WorkerSpec]) -> None:
        """Before the workers of one launch start (each by start()): a scheduler may place them as one (a
        Slurm gang job, all of them at once or none). Raises BackendError, leaving nothing behind, when the
        launch cannot be placed; its workers then fail to launch, as for start()'s error."""

    @abc.abstractmethod
    async def start(self, spec: WorkerSpec) -> HandleT:
        """The handle of a process started for `spec` (its argv, env, cwd, resources), once it has
        been created; raises BackendError, leaving nothing of that worker behind, when it cannot."""

    @abc.abstractmethod
    async def poll(self, handle: HandleT) -> int | None:
        """None while the process is alive, else its exit code (-N for signal N)."""

    @abc.abstractmethod
    async def wait(self, handle: HandleT) -> int:
        """The exit code, once the process has ended and output() holds all it wrote (at most
        OUTPUT_DRAIN_SECONDS after the exit): the session reports a worker's end only after this."""

    @abc.abstractmethod
    async def stop(self, handle: HandleT, grace: float = 5.0) -> None:
        """TERM, KILL after `grace` s; returns once the process has ended, its output read as for wait().
        Idempotent."""

    @abc.abstractmethod
    def output(self, handle: HandleT) -> str:
        """What the process wrote to its stdout and stderr so far (its log), the last part of it."""

    def exit_reason(self, handle: HandleT) -> str | None:
        """Why the process ended, when the backend knows more than its exit code (None otherwise)."""
        return None

    def exit_status(self, handle: HandleT) -> Status | None:
        """How a process the session did not stop ended, where its scheduler says more than its exit code
        (a job cancelled from outside: STOPPED); None: as its exit code says (FAILED)."""
        return None

    def waiting_reason(self, handle: HandleT) -> str | None:
        """Why a started worker does not run yet, in its scheduler's words (a queue's reason, the jobs ahead);
        None where the backend cannot say. Read for the messages of workers still starting."""
        return None

    async def close(self) -> None:
        """Release what the backend itself holds (networks, cgroups...)."""

    @classmethod
    def cleanup(cls, dry_run: bool, options: Mapping[str, Any]) -> list[str]:
        """End what sessions of this host whose process is gone left here (containers, pods): the
        names of what was ended (or, with dry_run, would be). `options` are the command line's (the
        Kubernetes namespace, say); a backend reads those it knows. Raises ConfigError when there is
        nothing to look at here (no engine, no cluster configured, no client installed).

        Worker processes and session folders on this host are the session records' (records.py),
        for every backend; this is for what lives elsewhere.
        """
        return []
