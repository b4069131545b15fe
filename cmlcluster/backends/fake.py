"""A scriptable fake backend, for unit tests of the session's orchestration.

No process starts. Each worker follows a FakeWorker script: how long it takes
to register, whether it ever does, what address it reports, what its program
prints and returns, when its process dies. The fake brings its own control
plane, because fake workers have no engine to talk to.

    backend = FakeBackend([FakeWorker(start_delay=0.2), FakeWorker(registers=False)])
    with Session(backend) as s: ...

Worker i of the session follows plan[i]; workers beyond the plan follow FakeWorker().
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..control.plane import ControlPlane, OutputCallback, WorkerInfo
from ..errors import BackendError, CmlClusterError
from ..resources import GpuPool
from ..workers import Program, Resources, WorkerSpec
from .base import Backend, Capabilities

SIGTERM_EXIT = -15


@dataclass(frozen=True)
class FakeWorker:
    start_delay: float = 0.0  # seconds from start until its engine registers
    registers: bool = True  # False: it never becomes ready
    silent_after: float | None = None  # the controller loses contact this long after it registered (unregister)
    answers: bool = True  # False: it registers, but its engine never answers
    launch_error: str | None = None  # start() fails with this message
    address: str | None = "auto"  # "auto": 10.0.0.<engine id + 1>; None: never known
    output: tuple[str, ...] = ()  # lines its program prints
    run_time: float = 0.0  # how long its program runs
    exit_code: int = 0  # what its program returns
    dies_after: float | None = None  # its process dies this long after start...
    death_code: int = -9  # ...with this exit code
    exit_time: float = 0.0  # seconds its process takes to go once stopped (its cleanup)
    cleanup_output: tuple[str, ...] = ()  # what its program prints as a stop ends it (its finally blocks)...
    cleanup_delay: float = 0.0  # ...reaching the session this long after its process is gone, with its result
    waiting: str | None = None  # why it does not run yet, as a scheduler's queue says it (waiting_reason)


@dataclass(eq=False)
class FakeHandle:
    spec: WorkerSpec
    script: FakeWorker
    exited: asyncio.Future[int]
    gpus: list[str] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    on_end: Callable[[FakeHandle], None] | None = None
    interrupted: asyncio.Future[None] | None = None  # set by an interrupt while its program runs

    def end(self, code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(code)
            if self.on_end is not None:
                self.on_end(self)
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()


class FakeBackend(Backend[FakeHandle]):
    name = "fake"

    def __init__(
        self,
        plan: Sequence[FakeWorker] | Callable[[int], FakeWorker] = (),
        gpus: Sequence[str] = (),
        capabilities: Capabilities | None = None,
    ):
        """capabilities: what the fake workers claim to be (default: remote hosts of their own)."""
        self._plan = plan
        self._capabilities = capabilities or Capabilities(
            own_address=True, session_host=False, python="python3", shared_paths=()
        )
        self._gpus = GpuPool(list(gpus))
        self.handles: dict[int, FakeHandle] = {}
        self.control = FakeControl(self)

    def _script(self, engine_id: int) -> FakeWorker:
        if callable(self._plan):
            return self._plan(engine_id)
        return self._plan[engine_id] if engine_id < len(self._plan) else FakeWorker()

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def control_plane(self) -> ControlPlane:
        return self.control

    async def check(self, n: int, resources: Resources) -> None:
        self._gpus.check(n, resources)

    async def start(self, spec: WorkerSpec) -> FakeHandle:
        script = self._script(spec.engine_id)
        if script.launch_error is not None:
            raise BackendError(script.launch_error)
        handle = FakeHandle(
            spec=spec,
            script=script,
            exited=asyncio.get_running_loop().create_future(),
            gpus=self._gpus.take(spec.resources.nvidia_gpu),
            on_end=lambda h: self._gpus.give_back(h.gpus),
        )
        self.handles[spec.engine_id] = handle
        if script.registers:
            handle.tasks.append(asyncio.create_task(self._register_later(handle)))
        if script.dies_after is not None:
            handle.tasks.append(asyncio.create_task(self._die_later(handle, script.dies_after, script.death_code)))
        return handle

    async def _register_later(self, handle: FakeHandle) -> None:
        await asyncio.sleep(handle.script.start_delay)
        if not handle.exited.done() and self.control.on_engine is not None:
            self.control.on_engine("register", handle.spec.engine_id)
        if handle.script.silent_after is not None:
            await asyncio.sleep(handle.script.silent_after)
            if not handle.exited.done() and self.control.on_engine is not None:
                self.control.on_engine("unregister", handle.spec.engine_id)

    async def _die_later(self, handle: FakeHandle, delay: float, code: int) -> None:
        await asyncio.sleep(delay)
        handle.printed.append(f"fake worker {handle.spec.worker_id} died with code {code}")
        handle.end(code)

    async def poll(self, handle: FakeHandle) -> int | None:
        return handle.exited.result() if handle.exited.done() else None

    async def wait(self, handle: FakeHandle) -> int:
        # Its process output (a death notice) is written before it ends: output() holds all of it.
        return await asyncio.shield(handle.exited)

    async def stop(self, handle: FakeHandle, grace: float = 5.0) -> None:
        if not handle.exited.done() and handle.script.exit_time:
            await asyncio.wait([handle.exited], timeout=min(handle.script.exit_time, grace))
        handle.end(SIGTERM_EXIT)

    def output(self, handle: FakeHandle) -> str:
        return "\n".join(handle.printed)

    def waiting_reason(self, handle: FakeHandle) -> str | None:
        return handle.script.waiting


class FakeControl(ControlPlane):
    def __init__(self, backend: FakeBackend):
        self._backend = backend
        self.started = False
        self.closed = False
        self.calls: list[tuple[int, str, tuple[Any, ...]]] = []
        # Answers call(); tests set it to play the worker's side of a framework.
        self.responder: Callable[[int, str, tuple[Any, ...]], Any] | None = None

    async def start(self, listen_ip: str, session_dir: str) -> None:
        self.started = True

    def agent_env(self) -> dict[str, str]:
        return {}

    async def describe(self, engine_id: int) -> WorkerInfo:
        handle = self._backend.handles[engine_id]
        if not handle.script.answers:
            raise TimeoutError(f"engine {engine_id} did not answer")
        address = handle.script.address
        if address == "auto":
            address = f"10.0.0.{engine_id + 1}"
        return WorkerInfo(ip_address=address, hostname=f"fake-{engine_id}", pid=None)

    async def run_program(self, engine_id: int, program: Program, on_output: OutputCallback) -> int:
        handle = self._backend.handles[engine_id]
        for line in handle.script.output:
            on_output("stdout", line + "\n")
        running: asyncio.Future[Any] = asyncio.ensure_future(asyncio.sleep(handle.script.run_time))
        exited: asyncio.Future[Any] = handle.exited
        handle.interrupted = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait([running, exited, handle.interrupted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            running.cancel()
        if handle.interrupted.done() and not exited.done():
            return SIGTERM_EXIT  # ended as a stop ends it, the agent still serving
        if handle.exited.done():
            if handle.script.cleanup_output and handle.exited.result() == SIGTERM_EXIT:
                # Stopped: the agent's program ends through its cleanup and says so, and that news
                # travels over the control plane, after the backend has seen the process go.
                await asyncio.sleep(handle.script.cleanup_delay)
                for line in handle.script.cleanup_output:
                    on_output("stdout", line + "\n")
                return SIGTERM_EXIT
            raise CmlClusterError(f"engine {engine_id} died while running its program")
        return handle.script.exit_code

    async def call(self, engine_id: int, target: str, args: tuple[Any, ...], on_output: OutputCallback) -> Any:
        self.calls.append((engine_id, target, args))
        if self.responder is None:
            raise CmlClusterError(f"fake worker {engine_id} runs no code (asked for {target})")
        return self.responder(engine_id, target, args)

    async def interrupt(self, engine_id: int) -> None:
        self.calls.append((engine_id, "interrupt", ()))
        interrupted = self._backend.handles[engine_id].interrupted
        if interrupted is not None and not interrupted.done():
            interrupted.set_result(None)

    async def xray(self, engine_id: int) -> dict[str, Any]:
        self.calls.append((engine_id, "xray", ()))
        if self.responder is None:
            raise CmlClusterError(f"fake worker {engine_id} runs no code (asked for its stacks)")
        answer: dict[str, Any] = self.responder(engine_id, "xray", ())
        return answer

    async def close(self) -> None:
        self.closed = True
