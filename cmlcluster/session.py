"""The session: owns a backend, a control plane, the worker records and their teardown.

Everything that changes a worker record happens on the session's loop thread,
driven by events: a backend reports a process exit, the control plane reports
an engine registration, a program's reply arrives. await_workers reacts to
those events; nothing here sleeps in polling loops.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from . import registry, shipping
from ._aio import LoopThread
from .backends import Backend, SessionContext, make_backend
from .control import ControlPlane, IPyParallelControl
from .errors import BackendError, CmlClusterError, ConfigError, WorkerError
from .events import Event, EventBus, LaunchFailed, OutputLine, SessionClosed, Subscriber, WorkerStatus
from .progress import output_event
from .workers import (
    FAILED,
    PACKAGE_PARENT,
    RUNNING,
    STOPPED,
    SUCCEEDED,
    TAIL_LINES,
    TIMEDOUT,
    Ending,
    Program,
    Resources,
    Worker,
    WorkerSpec,
    validate_launch,
)

log = logging.getLogger("cmlcluster")

STOP_GRACE = 5.0  # seconds between TERM and KILL
LOST_CONTACT_GRACE = 5.0  # after an engine unregisters, how long the backend gets to report the exit
# Once a worker's process is gone, how long its end waits for its program's result and last output,
# still on their way over the control plane (a stopped program's cleanup prints as the stop ends it).
EXIT_OUTPUT_GRACE = 2.0


@dataclass(frozen=True)
class Shipment:
    """Files on their way to workers that do not see them (see Session.ship)."""

    files: bytes  # a tar.gz, or b"" when the workers see everything already
    in_cwd: bool  # unpacked into the worker's own working folder, else into a private folder
    names: dict[str, str]  # a path on the session's machine -> how a program in the worker names it

    def program(self, **fields: Any) -> Program:
        """A Program carrying these files."""
        return Program(files=self.files, files_in_cwd=self.in_cwd, **fields)


T = TypeVar("T")

DRAIN_TIMEOUT = 1.0  # how long a sync call waits for subscribers to show what happened during it

_live_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
_serials = itertools.count()

# Called with every new session that shows itself (echo=True): the UI layer registers here when
# it is imported, so that the session never chooses a UI (cmlcluster.ui.attach).
viewers: list[Callable[[Session], None]] = []
UI_PACKAGE = "cmlcluster.ui"  # imported when the first session is shown; no worker imports it


def live_sessions() -> list[Session]:
    """The sessions of this process that are open, oldest first."""
    return sorted((s for s in list(_live_sessions) if not s.closed), key=lambda s: s._serial)


@atexit.register
def _close_live_sessions() -> None:
    for session in list(_live_sessions):
        with contextlib.suppress(Exception):
            session.close()


class Session:
    """A set of workers on one backend, with the ipyparallel controller they connect to.

    Use it as a context manager, or call close(); sessions still open when the
    interpreter exits are closed then. If the process is killed instead, the
    controller's lifeline ends the controller and every agent exits once the
    controller's heartbeat stops.
    """

    def __init__(self, backend: str | Backend = "local", *, echo: bool = True, **backend_options: Any):
        """echo: show the session (its workers, their output, training progress) with the UI
        registered in `viewers`: widgets in a notebook, progress bars or text in a terminal."""
        self.id = secrets.token_hex(3)
        self._serial = next(_serials)
        self.backend = make_backend(backend, **backend_options)
        self._loop = LoopThread(name=f"cmlcluster-{self.id}")
        self._dir: str | None = None
        self._control: ControlPlane | None = None
        self._attached = False  # whether the backend serves this session (from the first launch)
        self._workers: dict[str, Worker] = {}
        self._by_engine: dict[int, Worker] = {}
        self._next_engine_id = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._events = EventBus(f"cmlcluster-{self.id}")
        self._on_show: list[Callable[[], None]] = []
        self._boards: list[Any] = []  # TensorBoards started for this session, stopped with it
        self._record: registry.Recorder | None = None  # for `cmlcluster list` / `cleanup`
        self.view: Any = None  # what shows the session (a widget, a terminal view): set by the UI layer
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit_watchers: dict[str, asyncio.Task[None]] = {}
        self._programs: dict[str, asyncio.Future[Ending]] = {}  # each worker's program, run to its ending
        self._partial: dict[tuple[str, str], str] = {}
        self.closed = False
        _live_sessions.add(self)
        if echo:
            importlib.import_module(UI_PACKAGE)
            for attach in list(viewers):
                attach(self)

    # ---------------------------------------------------------------- sync API

    def launch_workers(
        self,
        n: int,
        cpu: float,
        memory: float,
        nvidia_gpu: int = 0,
        kernel: str = "python3",
        script: str = "",
        code: str = "",
        env: Mapping[str, str] | None = None,
        *,
        ship_working_folder: bool = False,
    ) -> list[dict[str, Any]]:
        """Start n workers; one dict per worker, a dict without "id" for one that could not start.

        A script the workers cannot read where it is (on SSH hosts, say) is shipped to them.
        ship_working_folder: ship the whole working folder too, to workers that do not see it
        (capped in size: see shipping.py); they start in their copy of it.
        """
        self._check_open()
        cwd = os.getcwd()
        program = validate_launch(n, cpu, memory, nvidia_gpu, kernel, script, code, env, cwd)
        shipment = self.ship([program.script] if program.script else [], working_folder=ship_working_folder)
        if shipment.files:
            program = replace(
                program,
                script=shipment.names.get(program.script, ""),
                files=shipment.files,
                files_in_cwd=shipment.in_cwd,
            )
        resources = Resources(cpu=float(cpu), memory=float(memory), nvidia_gpu=nvidia_gpu)
        self.show()
        return self._run(self._launch(n, resources, kernel, program, dict(env or {}), cwd))

    def ship(self, scripts: Iterable[str] = (), *, working_folder: bool = False) -> Shipment:
        """What must travel so that workers can run these scripts (and, if asked, see the working folder).

        Nothing travels to workers that see a file at its own path (local processes, a
        mounted folder). Refused before anything starts when too large (see shipping.py).
        """
        capabilities = self.backend.capabilities()
        cwd = os.getcwd()
        in_cwd = not capabilities.sees(cwd)  # then the worker's working folder is its own
        folder = cwd if working_folder and in_cwd else None
        names: dict[str, str] = {}
        files: dict[str, str] = {}
        for script in scripts:
            path = os.path.abspath(script)
            if capabilities.sees(path):
                names[script] = path
            elif folder is not None and path.startswith(folder.rstrip("/") + "/"):
                names[script] = os.path.relpath(path, folder)  # travels with the folder
            else:
                name = os.path.basename(path)
                while name in files and files[name] != path:
                    name = f"_{name}"  # two scripts of the same name from different folders
                files[name] = path
                names[script] = name
        archive = shipping.pack(files, folder) if files or folder else b""
        return Shipment(archive, in_cwd, names)

    def await_workers(
        self,
        ids: Iterable[str | Mapping[str, Any]],
        wait_for_completion: bool = True,
        timeout_seconds: float = 60,
        *,
        fail_fast: bool = False,
    ) -> dict[str, list[dict[str, Any]]]:
        """Wait until the workers run (or finish); returns {"workers": [...], "failures": [...]}.

        With fail_fast, return as soon as one of them fails; the ones still going are
        then listed among the failures with their current status.
        """
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or timeout_seconds < 0:
            raise ConfigError(f"timeout_seconds={timeout_seconds!r}: give seconds >= 0 (0 waits without a limit)")
        return self._run(self._await(list(ids), wait_for_completion, float(timeout_seconds), fail_fast))

    def list_workers(self) -> list[dict[str, Any]]:
        return self._read(lambda: [w.to_dict() for w in self._workers.values()])

    def stop_workers(self, *ids: str | Mapping[str, Any]) -> list[dict[str, Any]]:
        """Stop these workers (all of the session's when none are named), in parallel."""
        if self.closed:
            return []
        return self._run(self._stop([self._resolve(i) for i in ids] if ids else list(self._workers.values())))

    def stop_workers_soon(self, *ids: str | Mapping[str, Any], grace: float = STOP_GRACE) -> None:
        """Begin stopping these workers (TERM, KILL after `grace` s) and return at once.

        Callable from any thread, subscribers included.
        """
        if self.closed:
            return
        workers = [self._resolve(i) for i in ids]
        self._loop.call_soon(lambda: self._spawn(self._stop(workers, grace)))

    def run_program(self, workers: Iterable[str | Mapping[str, Any]], program: Program) -> list[dict[str, Any]]:
        """Give running workers that were launched without a program one to run now.

        Each then ends like a worker launched with it: succeeded or failed, then stopped.
        Wait for them with await_workers.
        """
        self._check_open()
        targets = [self._resolve(ref) for ref in workers]
        return self._run(self._run_later(targets, program))

    def call(self, worker: str | Mapping[str, Any], target: str, *args: Any, timeout: float | None = None) -> Any:
        """Call "module:function"(*args) inside a running worker and return what it returns.

        Its output joins the worker's output. An exception there raises WorkerError
        here, naming the worker and quoting the remote traceback.
        """
        return self.call_each([(worker, target, args)], timeout=timeout)[0]

    def call_each(
        self, calls: Iterable[tuple[str | Mapping[str, Any], str, tuple[Any, ...]]], timeout: float | None = None
    ) -> list[Any]:
        """Several calls, (worker, "module:function", args) each, in parallel; results in order.

        All of them finish (or time out) before the first failure is raised.
        """
        self._check_open()
        resolved = [(self._resolve(ref), target, tuple(args)) for ref, target, args in calls]

        async def all_calls() -> list[Any]:
            results = await asyncio.gather(
                *(self._call(w, t, a, timeout) for w, t, a in resolved), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

        return self._run(all_calls())

    def output(self, worker: str | Mapping[str, Any]) -> str:
        """The worker's output so far (the last lines of it)."""
        w = self._resolve(worker)
        return self._read(lambda: "\n".join(w.output))

    def worker_log(self, worker: str | Mapping[str, Any]) -> str:
        """The last part of what the worker's process wrote (its log, as its backend keeps it): what it
        printed before it reached the controller, say, which output() never sees."""
        w = self._resolve(worker)
        return self.backend.output(w.handle) if w.handle is not None else ""

    def worker_pid(self, worker: str | Mapping[str, Any]) -> int | None:
        """The worker's process id on this machine; None when it runs elsewhere (a container, a host)."""
        w = self._resolve(worker)
        return w.pid if self.backend.capabilities().session_host else None

    def tensorboard(self, logdir: str, port: int | None = None) -> Any:
        """Start TensorBoard on `logdir`, on 127.0.0.1 (port 6006 if free), stopped with the session.

        Returns a cmlcluster.tensorboard_server.TensorBoard; in a notebook it shows as a link
        (through jupyter-server-proxy when installed).
        """
        from .tensorboard_server import TensorBoard

        self._check_open()
        board = TensorBoard.start(logdir, port=port, session_dir=self._dir)
        self._boards.append(board)
        return board

    @property
    def session_dir(self) -> str | None:
        """The session's private folder (0700), removed at close; None before the first launch."""
        return self._dir

    @property
    def controller_ip(self) -> str:
        """This host's address as the session's workers reach it."""
        return self.backend.controller_ip()

    @property
    def client(self) -> Any:
        """The ipyparallel Client connected to this session's workers (None before the first launch)."""
        return self._control.client if self._control is not None else None

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(event)` with every event from now on (cmlcluster.events), in order, on a
        thread of the subscriber's own; returns the function that unsubscribes it."""
        return self._events.subscribe(callback)

    def publish(self, event: Event) -> None:
        """Tell the subscribers (a framework's job events, a coordinator's progress). Any thread."""
        if not self.closed:
            self._events.publish(event)

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Wait (at most `timeout` s) until subscribers have handled every event so far."""
        self._events.drain(timeout)

    def on_show(self, callback: Callable[[], None]) -> None:
        """Call `callback()` in the caller's thread whenever a call starts workers (launch_workers, and
        the frameworks through it), so that a UI can show itself where that call was made."""
        self._on_show.append(callback)

    def show(self) -> None:
        """Let the UI show this session here (in a notebook: in the cell now running)."""
        for callback in list(self._on_show):
            try:
                callback()
            except Exception:
                log.exception("cmlcluster: showing session %s failed", self.id)

    def _ipython_display_(self) -> None:
        if self._on_show:
            self.show()
        else:
            print(repr(self))  # shown without a UI (echo=False)

    def close(self) -> None:
        """Stop every worker, the controller and the session's loop; remove the session's files."""
        if self.closed:
            return
        self.closed = True
        _live_sessions.discard(self)
        for board in self._boards:
            with contextlib.suppress(Exception):
                board.stop()
        try:
            self._loop.run(self._close(), timeout=60)
        finally:
            self._loop.stop()
            self._events.publish(SessionClosed(self.id))
            self._events.close()
            if self._record is not None:
                self._record.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Session {self.id} backend={self.backend.name} workers={len(self._workers)}{state}>"

    # ---------------------------------------------------------------- core

    def _check_open(self) -> None:
        if self.closed:
            raise CmlClusterError(f"session {self.id} is closed; start a new one")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a core coroutine for a sync caller; what it caused is shown before the call returns."""
        self._check_open()
        try:
            return self._loop.run(coro)
        finally:
            self._events.drain(DRAIN_TIMEOUT)

    def _read(self, read: Callable[[], T]) -> T:
        """Read the records on the loop thread, where they change, so a reader never sees half a change."""
        if self.closed or self._loop.in_loop_thread:
            return read()  # nothing changes any more / already on the loop

        async def snapshot() -> T:
            return read()

        return self._loop.run(snapshot())

    def _resolve(self, ref: str | Mapping[str, Any]) -> Worker:
        worker_id = ref.get("id") if isinstance(ref, Mapping) else ref
        if worker_id not in self._workers:
            raise ConfigError(
                f"{ref!r} is not a worker of session {self.id}; known ids: {', '.join(self._workers) or 'none'}"
            )
        return self._workers[worker_id]

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cmlcluster session %s: internal task failed", self.id, exc_info=task.exception())

    async def _ensure_started(self) -> ControlPlane:
        """The control plane, started: agent_env() is known; control.ready() says when it serves."""
        if self._control is not None:
            return self._control
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix=f"cmlcluster-{self.id}-")
            os.chmod(self._dir, 0o700)  # holds the controller's keys
            self._record = registry.Recorder(self)
        if not self._attached:
            await self.backend.attach(SessionContext(session_id=self.id, session_dir=self._dir))
            self._attached = True
        control = self.backend.control_plane() or IPyParallelControl()
        control.on_engine = self._on_engine
        await control.start(self.backend.controller_ip(), self._dir)
        self._control = control
        return control

    def _make_spec(self, resources: Resources, env: dict[str, str], cwd: str, control: ControlPlane) -> WorkerSpec:
        engine_id = self._next_engine_id
        self._next_engine_id += 1
        worker_id = f"{self.id}-{engine_id}"
        master_ip = self.backend.controller_ip()
        capabilities = self.backend.capabilities()
        # The user's variables and cmlcluster's own; a backend on the session's own host adds the
        # session's environment (see Capabilities.session_host), no other backend sees it.
        worker_env = dict(env)
        worker_env.update(control.agent_env())
        worker_env.update(
            {
                "CDSW_MASTER_IP": master_ip,
                "CML_MASTER_IP": master_ip,
                "CDSW_MASTER_ID": self.id,
                "CDSW_ENGINE_ID": worker_id,
                "CMLCLUSTER_ENGINE_ID": str(engine_id),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if capabilities.sees(PACKAGE_PARENT):
            # Workers that see this checkout import the same cmlcluster as the session, installed or not.
            inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "") if capabilities.session_host else "")
            worker_env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, inherited) if p)
        return WorkerSpec(
            worker_id=worker_id,
            engine_id=engine_id,
            argv=(capabilities.python, "-m", "cmlcluster.agent"),
            env=worker_env,
            resources=resources,
            cwd=cwd,
        )

    async def _launch(
        self,
        n: int,
        resources: Resources,
        kernel: str,
        program: Program,
        env: dict[str, str],
        cwd: str,
    ) -> list[dict[str, Any]]:
        await self.backend.check(n, resources)
        control = await self._ensure_started()
        specs = [self._make_spec(resources, env, cwd, control) for _ in range(n)]
        workers = [Worker(spec=spec, program=program, kernel=kernel, backend=self.backend.name) for spec in specs]
        for w in workers:
            self._workers[w.id] = w
            self._by_engine[w.engine_id] = w
        # The workers start while the controller does (the first launch of a session): their
        # engines' registrations wait in ZeroMQ's queues until it listens.
        starting = asyncio.gather(*(self._start(w) for w in workers))
        try:
            try:
                await control.ready()
            except Exception:
                self._control = None  # closed by its failure: the next launch starts another
                await asyncio.wait([starting])  # every start ends, so that every started worker stops
                raise
            return list(await starting)
        except BaseException:
            # Interrupted mid-launch, or no controller: what this call started must not linger.
            starting.cancel()
            await asyncio.wait([starting])
            await asyncio.shield(self._stop([w for w in workers if w.handle is not None]))
            raise

    async def _start(self, worker: Worker) -> dict[str, Any]:
        try:
            worker.handle = await self.backend.start(worker.spec)
        except (BackendError, OSError) as e:
            del self._workers[worker.id]
            del self._by_engine[worker.engine_id]
            # CML's shape for a worker that could not be launched: no "id", a "message".
            message = f"could not launch worker {worker.id}: {e}"
            self._events.publish(LaunchFailed(message))
            return {"status": FAILED, "message": message}
        self._exit_watchers[worker.id] = self._spawn(self._watch_exit(worker))
        self._changed(worker)
        return worker.to_dict()

    async def _watch_exit(self, worker: Worker) -> None:
        # A worker's end is reported once all of its output is in: what its process wrote (the
        # backend's wait() returns once output() holds it all) and what its program printed.
        code = await self.backend.wait(worker.handle)
        program_ending = await self._program_ending_at_exit(worker)
        self._flush_partial(worker)
        ending = worker.ending or program_ending
        if ending is not None:  # decided before (see _end), or by its program; its place is free now
            exit_code = code if ending.exit_code is None else ending.exit_code
            changed = worker.finish(ending.status, exit_code=exit_code, message=ending.message)
        elif worker.stop_requested:
            changed = worker.finish(STOPPED, exit_code=code)
        else:
            reason = self.backend.exit_reason(worker.handle)
            changed = worker.finish(
                FAILED,
                exit_code=code,
                message=f"worker {worker.id} exited with code {code} {self._exit_moment(worker)}"
                f"{f' ({reason})' if reason else ''}{self._tail_for_message(worker)}",
            )
        if changed:
            self._changed(worker)

    @staticmethod
    def _exit_moment(worker: Worker) -> str:
        if worker.program_started:
            return "before its program finished"
        return "while it was running" if worker.running_at else "before it was running"

    def _tail_for_message(self, worker: Worker) -> str:
        tail = worker.output_tail()
        if not tail and worker.handle is not None:
            tail = "\n".join(self.backend.output(worker.handle).splitlines()[-TAIL_LINES:])
        return f"; last output:\n{tail}" if tail else "; it printed nothing"

    def _on_engine(self, kind: str, engine_id: int) -> None:
        worker = self._by_engine.get(engine_id)
        if worker is None or worker.finished:
            return
        if kind == "register":
            self._spawn(self._on_registered(worker))
        elif kind == "unregister":
            self._spawn(self._on_lost_contact(worker))

    async def _on_registered(self, worker: Worker) -> None:
        control = self._control
        assert control is not None
        try:
            info = await control.describe(worker.engine_id)
        except Exception as e:
            await self._fail_silent(worker, e)
            return
        if worker.finished:
            return
        worker.hostname, worker.pid = info.hostname, info.pid
        if not info.ip_address:
            return  # registered, address unknown: not running by CML's definition
        if worker.program.empty and worker.program.files:
            # No program, but files (the working folder): in place before the worker counts as running.
            try:
                await control.call(
                    worker.engine_id,
                    "cmlcluster.agent:unpack_files",
                    (worker.program.files, worker.program.files_in_cwd),
                    lambda s, t: self._on_output(worker, s, t),
                )
            except Exception as e:
                message = f"worker {worker.id} could not unpack the files shipped to it: {e}"
                await self._end(worker, Ending(FAILED, message=message))
                return
            if worker.finished:
                return
        worker.ip_address = info.ip_address
        worker.status = RUNNING
        worker.running_at = time.time()
        self._changed(worker)
        if not worker.program.empty:  # else it serves the control plane until stopped or given a program
            await self._run_program(worker)

    async def _fail_silent(self, worker: Worker, error: Exception) -> None:
        """A worker registered but its engine does not answer: fail it, saying what is known, and stop it."""
        if worker.finished or worker.ending is not None:
            return  # it exited meanwhile; the exit watcher said why
        code = await self.backend.poll(worker.handle)
        process = "is still running" if code is None else f"exited with code {code}"
        message = (
            f"worker {worker.id} (engine {worker.engine_id}) registered with the controller but did not "
            f"answer ({error}); its process {process}{self._tail_for_message(worker)}"
        )
        if await self._end(worker, Ending(FAILED, exit_code=code, message=message)):
            log.warning("cmlcluster: %s", message)

    async def _run_later(self, workers: list[Worker], program: Program) -> list[dict[str, Any]]:
        for w in workers:
            if w.status != RUNNING or w.program_started:
                state = "already has a program" if w.program_started else f"is {w.status}"
                raise ConfigError(f"worker {w.id} {state}; only running workers launched without one can be given one")
        for w in workers:
            w.program = program
            self._spawn(self._run_program(w))
        return [w.to_dict() for w in workers]

    async def _call(self, worker: Worker, target: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        control = self._control
        if worker.status != RUNNING or control is None:
            raise WorkerError(f"cannot call {target} on worker {worker.id}: it is {worker.status}", worker.id)
        call = asyncio.ensure_future(
            control.call(worker.engine_id, target, args, lambda s, t: self._on_output(worker, s, t))
        )
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            # Until it returns, the worker ends (the controller would notice only after missed
            # heartbeats, if ever), or the time is up.
            while not call.done():
                if worker.finished:
                    call.cancel()
                    raise WorkerError(f"worker {worker.id} was {worker.status} while {target} ran in it", worker.id)
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    call.cancel()
                    raise WorkerError(f"{target} on worker {worker.id} did not return within {timeout:g} s", worker.id)
                change = loop.create_future()
                self._waiters.append(change)
                await asyncio.wait({call, change}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if not change.done():
                    self._waiters.remove(change)
            return call.result()
        except WorkerError:
            raise
        except Exception as e:
            detail = getattr(e, "traceback", None) or f"{type(e).__name__}: {e}"
            raise WorkerError(f"{target} failed on worker {worker.id}:\n{detail}", worker.id) from None
        finally:
            self._flush_partial(worker)

    async def _run_program(self, worker: Worker) -> None:
        worker.program_started = True
        program = asyncio.ensure_future(self._program_ending(worker))
        self._programs[worker.id] = program
        try:
            ending = await program
        except Exception as e:
            if not worker.finished:
                # Let the backend report the exit first; its exit code says more.
                await asyncio.wait([self._exit_watchers[worker.id]], timeout=LOST_CONTACT_GRACE)
            await self._end(worker, Ending(FAILED, message=f"worker {worker.id} failed: {e}"))
            return
        # Like a CML worker, it ends when its program does.
        await self._end(worker, ending)

    async def _program_ending(self, worker: Worker) -> Ending:
        """Run the worker's program; how the worker ends, once the program's output has all come in."""
        control = self._control
        assert control is not None
        code = await control.run_program(worker.engine_id, worker.program, lambda s, t: self._on_output(worker, s, t))
        self._flush_partial(worker)
        if code == 0:
            return Ending(SUCCEEDED, exit_code=0)
        if worker.stop_requested:  # the stop's signal ended the program (agent.ProgramStopped)
            return Ending(STOPPED, exit_code=code)
        message = f"worker {worker.id} exited with code {code}{self._tail_for_message(worker)}"
        return Ending(FAILED, exit_code=code, message=message)

    async def _program_ending_at_exit(self, worker: Worker) -> Ending | None:
        """Its program's ending, for a worker whose process is gone: its result and last output may
        trail the process's end over the control plane (EXIT_OUTPUT_GRACE). None: no program, or
        none that ended with a result (its engine died with it)."""
        program = self._programs.get(worker.id)
        if program is None:
            return None
        if not program.done():
            await asyncio.wait([program], timeout=EXIT_OUTPUT_GRACE)
        if not program.done() or program.cancelled() or program.exception() is not None:
            return None
        return program.result()

    async def _on_lost_contact(self, worker: Worker) -> None:
        await asyncio.wait([self._exit_watchers[worker.id]], timeout=LOST_CONTACT_GRACE)
        message = f"worker {worker.id} lost contact with the controller (no heartbeat)"
        await self._end(worker, Ending(FAILED, message=message))

    async def _end(self, worker: Worker, ending: Ending) -> bool:
        """End a worker whose end is decided (its program returned, it failed): stop its process and
        report the end once the backend has the process gone. What is reported finished has given
        its place back (a host's slot, its GPUs): a launch right after fits, and never shares them
        with a process still cleaning up. False if its end was decided or reported already.
        """
        if worker.finished or worker.ending is not None:
            return False
        worker.ending = ending
        try:
            await self.backend.stop(worker.handle, STOP_GRACE)
        finally:
            # The exit watcher reports it as the process goes (_watch_exit); if the backend never
            # sees it go (it could not stop it), it is reported all the same.
            await asyncio.wait([self._exit_watchers[worker.id]], timeout=STOP_GRACE)
            if worker.finish(ending.status, exit_code=ending.exit_code, message=ending.message):
                self._changed(worker)
        return True

    def _on_output(self, worker: Worker, stream: str, text: str) -> None:
        key = (worker.id, stream)
        lines = (self._partial.pop(key, "") + text).split("\n")
        if lines[-1]:
            self._partial[key] = lines[-1]
        for line in lines[:-1]:
            self._output_line(worker, stream, line)

    def _flush_partial(self, worker: Worker) -> None:
        for stream in ("stdout", "stderr"):
            rest = self._partial.pop((worker.id, stream), "")
            if rest:
                self._output_line(worker, stream, rest)

    def _output_line(self, worker: Worker, stream: str, line: str) -> None:
        line = line.rstrip("\r")
        event = output_event(worker.id, stream, line)
        if isinstance(event, OutputLine):  # else a report(), not output
            worker.output.append(line)
        self._events.publish(event)

    def _changed(self, worker: Worker) -> None:
        """A worker's status changed: wake the waiters, tell the subscribers."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._events.publish(WorkerStatus(worker.to_dict()))

    async def _next_change(self, timeout: float | None) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(waiter, timeout)

    async def _await(
        self,
        refs: list[str | Mapping[str, Any]],
        wait_for_completion: bool,
        timeout: float,
        fail_fast: bool = False,
    ) -> dict[str, list[dict[str, Any]]]:
        failures: list[dict[str, Any]] = []
        workers: list[Worker] = []
        for ref in refs:
            if isinstance(ref, Mapping) and "id" not in ref:
                failures.append(dict(ref))  # a launch that failed stays a failure
            else:
                workers.append(self._resolve(ref))

        def decided(w: Worker) -> bool:
            return w.finished or (not wait_for_completion and w.status == RUNNING)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None

        def one_failed() -> bool:
            return fail_fast and any(w.status in (FAILED, STOPPED) for w in workers)

        while not all(decided(w) for w in workers) and not one_failed():
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                break
            await self._next_change(remaining)

        ok: list[dict[str, Any]] = []
        for w in workers:
            record = w.to_dict()
            wanted = SUCCEEDED if wait_for_completion else RUNNING
            if w.status == wanted:
                ok.append(record)
                continue
            if not decided(w) and one_failed():
                record["message"] = f"worker {w.id} was still {w.status} when another worker failed"
            elif not decided(w):
                record["status"] = TIMEDOUT
                record["message"] = f"worker {w.id} was still {w.status} after {timeout:g} s"
            elif not wait_for_completion and not record.get("message"):
                record["message"] = f"worker {w.id} {w.status} while waiting for it to run"
            failures.append(record)
        return {"workers": ok, "failures": failures}

    async def _stop(self, workers: list[Worker], grace: float = STOP_GRACE) -> list[dict[str, Any]]:
        live = [w for w in workers if not w.finished and w.handle is not None]
        for w in live:
            w.stop_requested = True
        await asyncio.gather(*(self.backend.stop(w.handle, grace) for w in live))
        # The exit watchers turn the exits into "stopped"; wait for them so callers see it.
        watchers = [self._exit_watchers[w.id] for w in live if w.id in self._exit_watchers]
        if watchers:
            await asyncio.wait(watchers, timeout=STOP_GRACE)
        return [w.to_dict() for w in workers]

    async def _close(self) -> None:
        # Each step runs even when one before it fails: a failing backend must not leave the
        # controller running or the session's folder (keys, logs) behind.
        steps = [self._stop_everything, self._cancel_tasks]
        if self._control is not None:
            steps.append(self._control.close)
        if self._attached:
            steps.append(self.backend.close)
        errors = []
        for step in steps:
            try:
                await step()
            except Exception as e:
                errors.append(e)
        if self._attached:
            self.backend.detach()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if errors:
            raise errors[0]

    async def _stop_everything(self) -> None:
        await self._stop(list(self._workers.values()))
        # A finished worker's process may still be on its way out (its program just
        # ended); stop is idempotent, so make sure of every one before the loop goes.
        handles = [w.handle for w in self._workers.values() if w.handle is not None]
        await asyncio.gather(*(self.backend.stop(h, STOP_GRACE) for h in handles))

    async def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
