"""The session: the user's verbs over one backend's workers.

What runs under it (its loop thread, folder, control plane and their teardown) is
runtime.py's; what happens to each worker is the supervisor's (supervisor.py), driven
by events on the loop thread; waiting is waiting.py's, what a worker starts with is
worker_env.py's, what travels to it is shipping.py's. Nothing here polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from . import blocking, checks, live, origin, records, shipping, viewers
from .backends import Backend, make_backend
from .collect import paths as results
from .errors import CmlClusterError, ConfigError
from .events import CallStarted, Event, Progress, Subscriber
from .runtime import DRAIN_TIMEOUT, Runtime
from .shipping import Shipment
from .stacks import XRay
from .stragglers import STRAGGLER_FRACTION, STRAGGLER_WINDOW, StragglerWatch
from .supervisor import STOP_GRACE
from .waiting import AwaitResult
from .wire import CONNECTION_ENV
from .workers import Program, Resources, StopResponse, WorkerSnapshot, validate_launch

T = TypeVar("T")

log = logging.getLogger(__name__)

# The controller pings every 250 ms; a silence shorter than a few pings would end workers at random.
MIN_SILENCE_TIMEOUT = 1.0


class Session:
    """A set of workers on one backend, with the ipyparallel controller they connect to.

    Use it as a context manager, or call close(); sessions still open when the
    interpreter exits are closed then. If the process is killed instead, the
    controller's lifeline ends the controller and every agent exits once the
    controller's heartbeat stops.
    """

    def __init__(
        self,
        backend: str | Backend = "local",
        *,
        echo: bool = True,
        silence_timeout: float | None = None,
        idle_timeout: float | None = None,
        ttl: float | None = None,
        straggler_fraction: float | None = STRAGGLER_FRACTION,
        straggler_window: float = STRAGGLER_WINDOW,
        **backend_options: Any,
    ):
        """echo: show the session (its workers, their output, training progress): widgets in a
        notebook, progress bars or text in a terminal (cmlcluster.ui).

        silence_timeout: seconds a worker may go without hearing from the session (a network blip)
        before it counts as lost: its agent ends it, and the session reports it failed. A worker whose
        process dies is reported at once all the same. Default: the backend's (60 s for workers on
        other machines or in containers, 10 s for local ones). The price of a long one: workers of a
        session that died unclosed run on for that long.

        idle_timeout: seconds a running worker may sit idle (its processes under 5 % of a core, its GPUs
        unused) before it is stopped, its row counting down in the last half of that time; any work sets
        its clock back (idle.py). None: never.

        ttl: seconds from the session's first launch after which every worker is stopped, busy or not,
        and the session launches no more. None: never.

        straggler_fraction, straggler_window: a rank (or TensorFlow task) whose reported steps come more
        than straggler_fraction slower than its peers' median over straggler_window seconds is named in
        the views and as a Straggler event (stragglers.py). straggler_fraction=None: never.
        """
        check_silence_timeout(silence_timeout)
        check_idle_timeout_and_ttl(idle_timeout, ttl)
        check_stragglers(straggler_fraction, straggler_window)
        self.id = secrets.token_hex(8)  # 64 bits: it names containers, pods and labels shared by everyone
        self.backend = make_backend(backend, **backend_options)
        self._rt = Runtime(
            self.id,
            self.backend,
            on_folder=self._start_record,
            silence_timeout=silence_timeout,
            idle_timeout=idle_timeout,
            ttl=ttl,
        )
        self._events = self._rt.events
        self._supervisor = self._rt.supervisor
        self._on_show: list[Callable[[CallStarted], None]] = []
        self._calls = itertools.count()
        self._in_call = threading.local()  # .depth: the calls of `showing` this thread is within; .call: its id
        self._launched_by: dict[str, str] = {}  # worker id -> the call that launched it
        self._on_close: list[Callable[[], None]] = []
        self._record: records.Recorder | None = None  # for `cmlcluster list` / `cleanup`
        self.closed = False
        if straggler_fraction is not None:
            self.subscribe(StragglerFlags(self, StragglerWatch(straggler_fraction, straggler_window)))
        live.add(self)
        if echo:
            viewers.attach(self)

    # ---------------------------------------------------------------- the worker API

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
        name: str = "",
        *,
        ship_working_folder: bool = False,
        replaces: str = "",
        collect: str | Iterable[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Start n workers; one dict per worker, a dict without "id" for one that could not start.

        name: the workers' name, in their dicts ("name") and views, as CML's newer workspaces take it.
        Each dict's "app_url" is where a browser opens what the worker serves on its CDSW_APP_PORT
        (apps/ports.py).

        A script the workers cannot read where it is (on SSH hosts, say) is shipped to them.
        ship_working_folder: ship the whole working folder too, to workers that do not see it
        (capped in size: see shipping.py); they start in their copy of it.
        collect: paths relative to the worker's working folder ("outputs", "model.keras") whose files
        come to the same paths in this working folder when the worker ends, as if it wrote to a shared
        disk (collect/paths.py); where workers see this folder, they are there already.
        replaces: a lost worker's id (a job's replacement, jobs.Restarts): where the backend can,
        they start where it ran (Capabilities.stable_addresses).
        """
        self._check_open()
        cwd = os.getcwd()
        program = validate_launch(n, cpu, memory, nvidia_gpu, kernel, script, code, env, cwd, name)
        paths = results.check_collect(collect)
        shipment = self.ship([program.script] if program.script else [], working_folder=ship_working_folder)
        if shipment.files:
            program = replace(
                program,
                script=shipment.names.get(program.script, ""),
                files=shipment.files,
                files_in_cwd=shipment.in_cwd,
            )
        resources = Resources(cpu=float(cpu), memory=float(memory), nvidia_gpu=nvidia_gpu)
        with self.showing("launch_workers"):
            launch = self._rt.launch(n, resources, kernel, program, dict(env or {}), cwd, replaces, paths, name)
            launched = self._run(launch)
            self._launched_by.update((w["id"], self._in_call.call) for w in launched if "id" in w)
            return launched

    def ship(self, scripts: Iterable[str] = (), *, working_folder: bool = False) -> Shipment:
        """What must travel so that workers can run these scripts (and, if asked, see the working folder).

        Nothing travels to workers that see a file at its own path (local processes, a
        mounted folder). Refused before anything starts when too large (see shipping.py).
        """
        return shipping.plan(scripts, working_folder, self.backend.capabilities().sees, os.getcwd())

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
        return self.wait_for(ids, wait_for_completion, timeout_seconds, fail_fast=fail_fast).to_dict()

    def wait_for(
        self,
        ids: Iterable[str | Mapping[str, Any]],
        wait_for_completion: bool = True,
        timeout_seconds: float = 60,
        *,
        fail_fast: bool = False,
    ) -> AwaitResult:
        """await_workers, typed: its result's workers and failures are WorkerSnapshots (to_dict(): CML's)."""
        if not checks.number(timeout_seconds, low=0):
            raise ConfigError(f"timeout_seconds={timeout_seconds!r}: give seconds >= 0 (0 waits without a limit)")
        ids = list(ids)
        awaited = tuple(str(i.get("id", "")) if isinstance(i, Mapping) else str(i) for i in ids)
        # The widget's Stop can end the wait (cmlcluster.blocking).
        with self.showing("await_workers", awaited), blocking.blocking(self):
            return self._run(self._rt.wait(ids, wait_for_completion, float(timeout_seconds), fail_fast))

    def list_workers(self) -> list[dict[str, Any]]:
        return [w.to_dict() for w in self.snapshots()]

    def snapshots(self) -> list[WorkerSnapshot]:
        """Every worker of the session as it is now (list_workers' dicts, typed)."""
        return self._read(lambda: [w.snapshot() for w in self._supervisor.workers.values()])

    def stop_workers(self, *ids: str | Mapping[str, Any]) -> list[StopResponse]:
        """Stop these workers (all of the session's when none are named), in parallel.

        One response per worker, as CML's: its dict, with `status_code` (200 once it has ended, also
        when it had ended before) and `ok`. An id that is no worker of this session raises ConfigError.
        """
        if self.closed:
            return []
        workers = [self._supervisor.resolve(i) for i in ids] if ids else list(self._supervisor.workers.values())
        return [StopResponse(w) for w in self._run(self._supervisor.stop(workers))]

    def stop_workers_soon(self, *ids: str | Mapping[str, Any], grace: float = STOP_GRACE) -> None:
        """Begin stopping these workers (TERM, KILL after `grace` s) and return at once. Any thread."""
        if self.closed:
            return
        workers = [self._supervisor.resolve(i) for i in ids]
        self._rt.loop.call_soon(lambda: self._supervisor.spawn(self._supervisor.stop(workers, grace)))

    def run_program(self, workers: Iterable[str | Mapping[str, Any]], program: Program) -> list[dict[str, Any]]:
        """Give running workers that were launched without a program one to run now.

        Each then ends like a worker launched with it: succeeded or failed, then stopped.
        Wait for them with await_workers.
        """
        self._check_open()
        targets = [self._supervisor.resolve(ref) for ref in workers]
        return self._run(self._supervisor.run_later(targets, program))

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
        resolved = [(self._supervisor.resolve(ref), target, tuple(args)) for ref, target, args in calls]

        async def all_calls() -> list[Any]:
            results = await asyncio.gather(
                *(self._supervisor.call(w, t, a, timeout) for w, t, a in resolved), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

        return self._run(all_calls())

    def xray(self, *ids: str | Mapping[str, Any]) -> XRay:
        """Where every rank of the running workers (all of the session's when none are named) is now:
        the Python stack of each thread of each worker's program and of every rank below it, gathered
        at once without stopping anything, grouped by identical stack, the odd ones out named.
        Print it for text; a notebook displays it."""
        self._check_open()
        workers = [self._supervisor.resolve(i) for i in ids] if ids else None
        return self._run(self._supervisor.xray(workers))

    def xray_soon(self, done: Callable[[XRay | BaseException], None], *ids: str) -> None:
        """Begin an X-ray and return at once; done(the X-ray, or what it raised) is called on the
        session's loop thread when it is in. Any thread (the widget's button)."""
        if self.closed:
            return
        workers = [self._supervisor.resolve(i) for i in ids] if ids else None

        async def xray() -> None:
            try:
                result: XRay | BaseException = await self._supervisor.xray(workers)
            except Exception as e:
                result = e
            done(result)

        self._rt.loop.call_soon(lambda: self._supervisor.spawn(xray()))

    def output(self, worker: str | Mapping[str, Any]) -> str:
        """The worker's output so far (the last lines of it)."""
        w = self._supervisor.resolve(worker)
        return self._read(lambda: "\n".join(w.output))

    def worker_log(self, worker: str | Mapping[str, Any]) -> str:
        """The last part of what the worker's process wrote (its log, as its backend keeps it): what it
        printed before it reached the controller, say, which output() never sees."""
        w = self._supervisor.resolve(worker)
        return self.backend.output(w.handle) if w.handle is not None else ""

    def worker_log_path(self, worker: str | Mapping[str, Any]) -> str:
        """The file of the worker's whole log (capped), kept after the session: `cmlcluster logs` shows it."""
        return self.backend.context.log_path(self._supervisor.resolve(worker).spec.worker_id)

    def worker_pid(self, worker: str | Mapping[str, Any]) -> int | None:
        """The worker's process id on this machine; None when it runs elsewhere (a container, a host)."""
        w = self._supervisor.resolve(worker)
        return w.pid if self.backend.capabilities().session_host else None

    def tensorboard(self, logdir: str, port: int | None = None) -> Any:
        """Start TensorBoard on `logdir`, on 127.0.0.1 (port 6006 if free), stopped with the session.

        Returns a cmlcluster.tensorboard_server.TensorBoard; in a notebook it shows as a link
        (through jupyter-server-proxy when installed).
        """
        from .tensorboard_server import TensorBoard

        self._check_open()
        board = TensorBoard.start(logdir, port=port, session_dir=self._rt.dir)
        self.on_close(board.stop)
        return board

    @property
    def session_dir(self) -> str | None:
        """The session's private folder (0700), removed at close; None before the first launch."""
        return self._rt.dir

    @property
    def log_folder(self) -> str | None:
        """The folder of the workers' logs, `<worker id>.log` each, kept after the session (`cmlcluster logs`);
        None before the first launch."""
        return self._rt.logs or None

    @property
    def silence_timeout(self) -> float:
        """Seconds of silence after which a worker counts as lost: the one given, else the backend's."""
        return self._rt.silence_timeout

    @property
    def controller_ip(self) -> str:
        """This host's address as the session's workers reach it."""
        return self.backend.controller_ip()

    @property
    def controller_address(self) -> str:
        """ "ip:port" where the session's workers register with its controller; "" before the first launch."""
        control = self._supervisor.control
        return origin.controller_address(control.agent_env().get(CONNECTION_ENV, "")) if control is not None else ""

    @property
    def client(self) -> Any:
        """The ipyparallel Client connected to this session's workers (None before the first launch)."""
        control = self._supervisor.control
        return control.client if control is not None else None

    # ---------------------------------------------------------------- events and hooks

    def subscribe(self, callback: Subscriber, after_batch: Callable[[], None] | None = None) -> Callable[[], None]:
        """Call `callback(event)` with every event from now on (cmlcluster.events), in order, on a
        thread of the subscriber's own; returns the function that unsubscribes it. `after_batch()`, if
        given, is called after each run of events delivered together (one write for many changes)."""
        return self._events.subscribe(callback, after_batch)

    def publish(self, event: Event) -> None:
        """Tell the subscribers (a framework's job events, a coordinator's progress). Any thread."""
        if not self.closed:
            self._events.publish(event)

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Wait (at most `timeout` s) until subscribers have handled every event so far."""
        self._events.drain(timeout)

    def on_show(self, callback: Callable[[CallStarted], None]) -> None:
        """Call `callback(call)` in the caller's thread whenever a call that starts or waits for work
        begins (`showing`), before its CallStarted event: a UI shows that call's view where it was made."""
        self._on_show.append(callback)

    @contextlib.contextmanager
    def showing(self, title: str, workers: Iterable[str] = ()) -> Iterator[None]:
        """Mark a call that starts or waits for work (launch_workers, run_cluster, a run): its view shows
        what it does. Calls within it (run_cluster's launches and waits) are part of it. `workers`: the
        ids of earlier workers it is about (await_workers')."""
        depth = getattr(self._in_call, "depth", 0)
        if depth == 0:
            call = CallStarted(f"{self.id}-{next(self._calls)}", title, tuple(workers))
            self._in_call.call = call.call
            if not self.closed:
                for hook in list(self._on_show):  # one that fails does not keep the others from running
                    try:
                        hook(call)
                    except Exception:
                        log.exception("cmlcluster: showing session %s: %r failed", self.id, hook)
                self.publish(call)
        self._in_call.depth = depth + 1
        try:
            yield
        finally:
            self._in_call.depth = depth

    def launched_by(self, worker: str | Mapping[str, Any]) -> str | None:
        """The call (CallStarted.call) that launched this worker; None for an id it does not know."""
        return self._launched_by.get(str(worker.get("id", "")) if isinstance(worker, Mapping) else str(worker))

    def _ipython_display_(self) -> None:
        """The whole session's view, as a cell's value (every worker, all output), or its repr without one."""
        if not viewers.display(self):
            print(repr(self))  # shown without a widget (echo=False, or outside a kernel)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback()` when the session closes, before its workers stop (a TensorBoard's stop, say)."""
        self._on_close.append(callback)

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop every worker, the controller and the session's loop; remove the session's files."""
        if self.closed:
            return
        self.closed = True
        live.discard(self)
        self._call_hooks(self._on_close, "closing")
        try:
            self._rt.close()
        finally:
            if self._record is not None:
                self._record.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Session {self.id} backend={self.backend.name} workers={len(self._supervisor.workers)}{state}>"

    def _check_open(self) -> None:
        if self.closed:
            raise CmlClusterError(f"session {self.id} is closed; start a new one")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        self._check_open()
        return self._rt.run(coro)

    def _read(self, read: Callable[[], T]) -> T:
        return self._rt.read(read, self.closed)

    def _call_hooks(self, hooks: list[Callable[[], None]], doing: str) -> None:
        for hook in list(hooks):  # one that fails does not keep the others from running
            try:
                hook()
            except Exception:
                log.exception("cmlcluster: %s session %s: %r failed", doing, self.id, hook)

    def _start_record(self) -> None:
        self._record = records.Recorder(self)


class StragglerFlags:
    """The session's subscriber that feeds its progress reports to the straggler watch and publishes the
    flags it raises (on the bus's delivery thread: the watch has no other user)."""

    def __init__(self, session: Session, watch: StragglerWatch):
        self._session, self._watch = session, watch

    def __call__(self, event: Event) -> None:
        if isinstance(event, Progress):
            for flag in self._watch.sample(event):
                self._session.publish(flag)


def check_stragglers(fraction: object, window: object) -> None:
    """Refuse a straggler_fraction that is not None or a number between 0 and 1, or a straggler_window
    that is not a number of seconds >= 1, before anything starts."""
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0 < fraction < 1):
        raise ConfigError(
            f"straggler_fraction={fraction!r}: give the share of the median's pace a rank may fall behind by, "
            "between 0 and 1 (0.3: 30 % slower), or None to name no stragglers"
        )
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not window >= 1:
        raise ConfigError(f"straggler_window={window!r}: give the seconds a pace is measured over, 1 or more (30)")


def check_idle_timeout_and_ttl(idle_timeout: object, ttl: object) -> None:
    """Refuse an idle_timeout or ttl that is not None or a number of seconds >= 1, before anything starts."""
    for option, value in (("idle_timeout", idle_timeout), ("ttl", ttl)):
        if value is not None and not checks.number(value, low=1):
            raise ConfigError(
                f"{option}={value!r}: give a number of seconds >= 1 (e.g. {option}=3600), or None for none"
            )


def check_silence_timeout(value: object) -> None:
    """Refuse a silence_timeout that is not None or a number of seconds >= 1, before anything starts."""
    if value is not None and not checks.number(value, low=MIN_SILENCE_TIMEOUT):
        raise ConfigError(
            f"silence_timeout={value!r}: give the seconds a worker may go without hearing from the session "
            f"before it counts as lost, a number >= {MIN_SILENCE_TIMEOUT:g} (e.g. silence_timeout=60), or None "
            "for the backend's default"
        )
