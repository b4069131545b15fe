"""The worker state machine: the only code that changes a worker's record.

Four sources drive it, all on the session's loop thread: the backend (a process
started, a process gone), the control plane (an engine registered, or went silent),
a worker's program (its result, its output) and the session's own requests (stop).
Each change wakes the waiters (waiting.Changes) and is published as an event.

A worker's end is reported once everything of it is in: its process is gone (its
place, a host's slot or its GPUs, is free again) and its last output has arrived.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import Any

from .backends import Backend
from .collect.through_agents import CollectThroughAgents
from .control.plane import HUB_SILENCE_MARGIN, ControlPlane
from .errors import BackendError, ConfigError, WorkerError
from .events import EventBus, LaunchFailed, OutputLine, ResourceUse, WorkerStatus
from .idle import IDLE_MARK, IdleClock, ttl_message
from .leftovers import Leftovers
from .lines import LineSplitter
from .progress import output_event
from .stacks import XRay, gather
from .stacks.gather import GATHER_SECONDS
from .stacks.report import NOTEBOOK
from .usage import decode as decode_usage
from .waiting import Changes
from .wire import SILENCE_EXIT
from .worker_env import short_label
from .workers import FAILED, RUNNING, SCHEDULING, STOPPED, SUCCEEDED, TAIL_LINES, Ending, Program, Worker, WorkerSpec

log = logging.getLogger(__name__)

STOP_GRACE = 5.0  # seconds between TERM and KILL
LOST_CONTACT_GRACE = 5.0  # after an engine unregisters, how long the backend gets to report the exit
# Once a worker's process is gone, how long its end waits for its program's result and last output,
# still on their way over the control plane (a stopped program's cleanup prints as the stop ends it).
EXIT_OUTPUT_GRACE = 2.0
XRAY_ANSWER_SECONDS = GATHER_SECONDS + 5.0  # a worker's gather, and the way there and back
WAITING_POLL = 2.0  # seconds between asks of a scheduler why a worker does not run yet (its queue's reason)


class Supervisor:
    """The workers of one session, from start to end."""

    def __init__(
        self,
        session_id: str,
        backend: Backend,
        events: EventBus,
        silence_timeout: float,
        idle_timeout: float | None = None,
        ttl: float | None = None,
    ):
        self.session_id = session_id
        self.backend = backend
        self.control: ControlPlane | None = None  # the session's, once started (use_control); None after it failed
        self.silence_timeout = silence_timeout  # the session's: what its agents and controller allow a worker
        self.workers: dict[str, Worker] = {}
        self.changes = Changes()
        self._events = events
        self._by_engine: dict[int, Worker] = {}
        self._next_engine_id = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit_watchers: dict[str, asyncio.Task[None]] = {}
        self._programs: dict[str, asyncio.Future[Ending]] = {}  # each worker's program, running or run to its ending
        self._lines: dict[tuple[str, str], LineSplitter] = {}  # per worker and stream, its line being written
        self.leftovers = Leftovers(self)  # what a worker's own folder holds, said before it goes
        self.collecting = CollectThroughAgents(self)  # collect= files the backend cannot take itself
        self.idle = IdleClock(idle_timeout) if idle_timeout else None  # the session's idle_timeout (idle.py)
        self.ttl = ttl  # the session's (idle.py): its workers' time from its first launch
        self._ttl_guard: asyncio.Task[None] | None = None
        self.ttl_ran_out = False

    def use_control(self, control: ControlPlane) -> None:
        """The session's control plane, started: the workers' engines register with it."""
        self.control = control

    def program(self, worker_id: str) -> asyncio.Future[Ending] | None:
        """The worker's program, running or run to its ending; None before one was run (supervision)."""
        return self._programs.get(worker_id)

    async def interrupt(self, worker: Worker) -> None:
        """End the worker's running program as a stop does, its agent serving on (supervision)."""
        worker.stop_requested = True  # its program's end is a stop's (_program_ending)
        assert self.control is not None  # a worker with a program has registered
        await self.control.interrupt(worker.engine_id)

    def new_engine_id(self) -> int:
        engine_id = self._next_engine_id
        self._next_engine_id += 1
        return engine_id

    def resolve(self, ref: str | Mapping[str, Any]) -> Worker:
        worker_id = ref.get("id") if isinstance(ref, Mapping) else ref
        if worker_id not in self.workers:
            raise ConfigError(
                f"{ref!r} is not a worker of session {self.session_id}; known ids: {', '.join(self.workers) or 'none'}"
            )
        return self.workers[worker_id]

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cmlcluster session %s: internal task failed", self.session_id, exc_info=task.exception())

    # ------------------------------------------------------------ starting

    async def launch(self, specs: list[WorkerSpec], program: Program, kernel: str) -> list[dict[str, Any]]:
        """Start a worker per spec while the control plane comes up; their dicts (see _start).

        Interrupted, or the control plane failed: what this call started is stopped.
        """
        control = self.control
        assert control is not None
        if self.ttl_ran_out:
            raise ConfigError(f"ttl={self.ttl:g}: this session's time ran out, and it launches no more; start another")
        if self.ttl and self._ttl_guard is None:
            self._ttl_guard = self.spawn(self._end_at_ttl(self.ttl))
        workers = [Worker(spec=spec, program=program, kernel=kernel, backend=self.backend.name) for spec in specs]
        try:
            await self.backend.prepare_launch(specs)
        except (BackendError, OSError) as e:
            return [self._launch_failed(w, e) for w in workers]
        for w in workers:
            self.workers[w.id] = w
            self._by_engine[w.engine_id] = w
        # The workers start while the controller does (the first launch of a session): their
        # engines' registrations wait in ZeroMQ's queues until it listens.
        starting = asyncio.gather(*(self._start(w) for w in workers))
        try:
            try:
                await control.ready()
            except Exception:
                self.control = None  # closed by its failure: the next launch starts another
                await asyncio.wait([starting])  # every start ends, so that every started worker stops
                raise
            return list(await starting)
        except BaseException:
            starting.cancel()
            await asyncio.wait([starting])
            await asyncio.shield(self.stop([w for w in workers if w.handle is not None]))
            raise

    async def _start(self, worker: Worker) -> dict[str, Any]:
        try:
            worker.handle = await self.backend.start(worker.spec)
        except (BackendError, OSError) as e:
            del self.workers[worker.id]
            del self._by_engine[worker.engine_id]
            return self._launch_failed(worker, e)
        self._exit_watchers[worker.id] = self.spawn(self._watch_exit(worker))
        if type(self.backend).waiting_reason is not Backend.waiting_reason:  # a scheduler's queue can say why
            self.spawn(self._follow_waiting(worker))
        self._changed(worker)
        return worker.to_dict()

    def _launch_failed(self, worker: Worker, error: Exception) -> dict[str, Any]:
        # CML's shape for a worker that could not be launched: no "id", a "message".
        message = f"could not launch worker {worker.id}: {error}"
        self._events.publish(LaunchFailed(message))
        return {"status": FAILED, "message": message}

    async def _follow_waiting(self, worker: Worker) -> None:
        """While the worker is scheduling, its message is why it waits, in its scheduler's words, as they change:
        the views and list_workers show it (a Slurm job's "PENDING (Resources), 2 jobs ahead")."""
        while worker.status == SCHEDULING:
            waiting = self.backend.waiting_reason(worker.handle)
            if waiting != worker.message and worker.status == SCHEDULING:
                worker.message = waiting
                self._changed(worker)
            await asyncio.sleep(WAITING_POLL)

    def on_engine(self, kind: str, engine_id: int) -> None:
        """The control plane's report: an engine registered, or went silent."""
        worker = self._by_engine.get(engine_id)
        if worker is None or worker.finished:
            return
        if kind == "register":
            self.spawn(self._on_registered(worker))
        elif kind == "unregister":
            self.spawn(self._on_lost_contact(worker))

    async def _on_registered(self, worker: Worker) -> None:
        control = self.control
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
                    "cmlcluster.agent.main:unpack_files",
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
        worker.message = None  # why it waited, if it did
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
            f"answer ({error}); its process {process}{self.last_output_for_message(worker)}"
        )
        if await self._end(worker, Ending(FAILED, exit_code=code, message=message)):
            log.warning("cmlcluster: %s", message)

    def on_usage(self, engine_id: int, sample: Mapping[str, Any]) -> None:
        """The control plane's report: a worker's agent sent what the worker uses now (usage.py). Kept as
        its dict's fields (list_workers) until it ends, and published."""
        worker = self._by_engine.get(engine_id)
        if worker is None or worker.finished:
            return
        use = decode_usage(worker.id, sample)
        if use is None:
            return
        worker.usage = use.fields()
        self._events.publish(use)
        if self.idle is not None and worker.status == RUNNING:
            self._watch_idle(worker, use)

    def _watch_idle(self, worker: Worker, use: ResourceUse) -> None:
        """Its idle clock, from this sample: a countdown in its row near idle_timeout, then a stop (idle.py)."""
        assert self.idle is not None
        now = time.monotonic()
        self.idle.sample(worker.id, use, now)
        said = self.idle.message(worker.id, now)
        if self.idle.expired(worker.id, now):
            self.idle.forget(worker.id)
            log.warning("cmlcluster: worker %s %s", worker.id, said)
            self.spawn(self._end(worker, Ending(STOPPED, message=f"worker {worker.id} {said}")))
            return
        counting = worker.message is not None and worker.message.startswith(IDLE_MARK)
        if said != worker.message and (said is not None or counting):
            worker.message = said
            self._changed(worker)

    async def _end_at_ttl(self, ttl: float) -> None:
        await asyncio.sleep(ttl)
        self.ttl_ran_out = True
        said = ttl_message(ttl)
        live = [w for w in self.workers.values() if not w.finished and w.handle is not None]
        if live:
            log.warning("cmlcluster: session %s %s; stopping its %d workers", self.session_id, said, len(live))
        await asyncio.gather(*(self._end(w, Ending(STOPPED, message=f"worker {w.id} {said}")) for w in live))

    # ------------------------------------------------------------ programs and calls

    async def run_later(self, workers: list[Worker], program: Program) -> list[dict[str, Any]]:
        for w in workers:
            if w.status != RUNNING or w.program_started:
                state = "already has a program" if w.program_started else f"is {w.status}"
                raise ConfigError(f"worker {w.id} {state}; only running workers launched without one can be given one")
        for w in workers:
            w.program = program
            self.spawn(self._run_program(w))
        return [w.to_dict() for w in workers]

    async def call(self, worker: Worker, target: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        control = self.control
        if worker.status != RUNNING or control is None:
            raise WorkerError(f"cannot call {target} on worker {worker.id}: it is {worker.status}", worker.id)
        call = asyncio.ensure_future(
            control.call(worker.engine_id, target, args, lambda s, t: self._on_output(worker, s, t))
        )
        self.leftovers.busy[worker.id] += 1
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
                change = self.changes.next()
                await asyncio.wait({call, change}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                self.changes.forget(change)
            return call.result()
        except WorkerError:
            raise
        except Exception as e:
            detail = getattr(e, "traceback", None) or f"{type(e).__name__}: {e}"
            raise WorkerError(f"{target} failed on worker {worker.id}:\n{detail}", worker.id) from None
        finally:
            self.leftovers.busy[worker.id] -= 1
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
        await self.collecting.take(worker)
        await self.leftovers.before_stop([worker])
        await self._end(worker, ending)

    async def _program_ending(self, worker: Worker) -> Ending:
        """Run the worker's program; how the worker ends, once the program's output has all come in."""
        control = self.control
        assert control is not None
        code = await control.run_program(worker.engine_id, worker.program, lambda s, t: self._on_output(worker, s, t))
        self._flush_partial(worker)
        if code == 0:
            return Ending(SUCCEEDED, exit_code=0)
        if worker.stop_requested:  # the stop's signal ended the program (agent_program.ProgramStopped)
            return Ending(STOPPED, exit_code=code)
        message = f"worker {worker.id} exited with code {code}{self.last_output_for_message(worker)}"
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

    # ------------------------------------------------------------ ending

    async def _watch_exit(self, worker: Worker) -> None:
        # A worker's end is reported once all of its output is in: what its process wrote (the
        # backend's wait() returns once output() holds it all) and what its program printed.
        code = await self.backend.wait(worker.handle)
        self.collecting.ended_untaken(worker)
        program_ending = await self._program_ending_at_exit(worker)
        self._flush_partial(worker)
        ending = worker.ending or program_ending
        if ending is not None:  # decided before (see _end), or by its program; its place is free now
            exit_code = code if ending.exit_code is None else ending.exit_code
            changed = worker.finish(ending.status, exit_code=exit_code, message=ending.message)
        elif worker.stop_requested:
            changed = worker.finish(STOPPED, exit_code=code)
        else:
            reason = self.backend.exit_reason(worker.handle) or self._agent_exit_reason(code)
            changed = worker.finish(
                self.backend.exit_status(worker.handle) or FAILED,
                exit_code=code,
                message=f"worker {worker.id} exited with code {code} {_exit_moment(worker)}"
                f"{f' ({reason})' if reason else ''}{self.last_output_for_message(worker)}",
            )
        if changed:
            self._changed(worker)

    def _agent_exit_reason(self, code: int) -> str | None:
        if code != SILENCE_EXIT:
            return None
        return (
            f"its agent heard nothing from the session for {self.silence_timeout:g} s (silence_timeout) and "
            "ended it: the network between them, or the session, stopped answering"
        )

    async def _on_lost_contact(self, worker: Worker) -> None:
        # The hub heard nothing for silence_timeout + HUB_SILENCE_MARGIN: the agent should have ended
        # the worker by now, and the backend reported it. Neither did: the worker is cut off.
        await asyncio.wait([self._exit_watchers[worker.id]], timeout=LOST_CONTACT_GRACE)
        message = (
            f"worker {worker.id} lost contact with the controller: no heartbeat for "
            f"{self.silence_timeout + HUB_SILENCE_MARGIN:g} s (silence_timeout={self.silence_timeout:g} s)"
        )
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

    async def xray(self, workers: list[Worker] | None) -> XRay:
        """The stacks of every running worker among `workers` (None: the session's unfinished ones) and
        of its ranks, asked of all at once (stacks/); those not running, or that did not answer, are
        named with why."""
        started = time.monotonic()
        if workers is None:
            workers = [w for w in self.workers.values() if not w.finished]
        asked = [w for w in workers if w.status == RUNNING and self.control is not None]
        unanswered = {short_label(w.id): f"it is {w.status}" for w in workers if w not in asked}
        control = self.control
        answers: dict[str, dict[str, Any]] = {}
        # Ranks the session's own process started (horovodrun's, on the local backend) are read here; local
        # workers' agents answer for what runs below them.
        capabilities = self.backend.capabilities()
        agents = [
            w.pid for w in self.workers.values() if w.pid and capabilities.session_host and not capabilities.own_address
        ]
        here = asyncio.create_task(asyncio.to_thread(gather.below, time.monotonic() + GATHER_SECONDS, agents, True))
        if control is not None and asked:
            results = await asyncio.gather(
                *(asyncio.wait_for(control.xray(w.engine_id), XRAY_ANSWER_SECONDS) for w in asked),
                return_exceptions=True,
            )
            for worker, result in zip(asked, results, strict=True):
                name = short_label(worker.id)
                if isinstance(result, asyncio.TimeoutError):
                    unanswered[name] = f"no answer within {XRAY_ANSWER_SECONDS:g} s"
                elif isinstance(result, BaseException):
                    unanswered[name] = str(result) or type(result).__name__
                else:
                    answers[name] = result
        ranks_here = await here
        if ranks_here:
            answers[NOTEBOOK] = {"processes": ranks_here}
        return XRay.from_answers(answers, unanswered, time.monotonic() - started)

    async def stop(self, workers: list[Worker], grace: float = STOP_GRACE) -> list[dict[str, Any]]:
        """Stop these workers in parallel (TERM, KILL after `grace` s); their dicts once they are stopped."""
        live = [w for w in workers if not w.finished and w.handle is not None]
        await self.collecting.before_stop(live)
        await self.leftovers.before_stop(live)
        for w in live:
            w.stop_requested = True
        await asyncio.gather(*(self.backend.stop(w.handle, grace) for w in live))
        # The exit watchers turn the exits into "stopped"; wait for them so callers see it.
        watchers = [self._exit_watchers[w.id] for w in live if w.id in self._exit_watchers]
        if watchers:
            await asyncio.wait(watchers, timeout=STOP_GRACE)
        return [w.to_dict() for w in workers]

    async def stop_everything(self) -> None:
        await self.stop(list(self.workers.values()))
        # A finished worker's process may still be on its way out (its program just ended); stop is idempotent.
        handles = [w.handle for w in self.workers.values() if w.handle is not None]
        await asyncio.gather(*(self.backend.stop(h, STOP_GRACE) for h in handles))

    async def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    # ------------------------------------------------------------ output and changes

    def _on_output(self, worker: Worker, stream: str, text: str) -> None:
        splitter = self._lines.setdefault((worker.id, stream), LineSplitter())
        for line in splitter.feed(text):
            self._output_line(worker, stream, line)

    def _flush_partial(self, worker: Worker) -> None:
        for stream in ("stdout", "stderr"):
            splitter = self._lines.pop((worker.id, stream), None)
            for line in splitter.flush() if splitter is not None else ():
                self._output_line(worker, stream, line)

    def _output_line(self, worker: Worker, stream: str, line: str) -> None:
        event = output_event(worker.id, stream, line)
        if isinstance(event, OutputLine):  # else a report(), not output
            worker.output.append(line)
        self._events.publish(event)

    def last_output_for_message(self, worker: Worker) -> str:
        """A message's end: its program's last lines, or its process's (its agent's, while it starts)."""
        tail = worker.output_tail()
        waiting = None
        if worker.handle is not None and not worker.running_at:
            waiting = self.backend.waiting_reason(worker.handle)  # a scheduler's queue: why it does not run yet
        if not tail and worker.handle is not None:
            tail = "\n".join(self.backend.output(worker.handle).splitlines()[-TAIL_LINES:])
        said = f"; {waiting}" if waiting else ""
        return f"{said}; last output:\n{tail}" if tail else f"{said}; it printed nothing"

    def _changed(self, worker: Worker) -> None:
        """A worker's status changed: wake the waiters, tell the subscribers."""
        self.changes.notify()
        self._events.publish(WorkerStatus(worker.snapshot()))


def _exit_moment(worker: Worker) -> str:
    if worker.program_started:
        return "before its program finished"
    return "while it was running" if worker.running_at else "before it was running"
