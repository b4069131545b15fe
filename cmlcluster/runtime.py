"""What runs under a session: its loop thread, its event bus, its private folder, the backend's
attachment and the control plane, started at the first launch and torn down once, each step
even when one before it fails."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from . import waiting, worker_logs
from ._aio import LoopThread
from .apps import ports as app_ports
from .backends import Backend, SessionContext
from .control.plane import ControlPlane, IPyParallelControl
from .events import EventBus, SessionClosed
from .supervisor import Supervisor
from .worker_env import build_spec
from .workers import Program, Resources, Worker

T = TypeVar("T")

DRAIN_TIMEOUT = 1.0  # how long a sync call waits for subscribers to show what happened during it
CLOSE_TIMEOUT = 60.0


class Runtime:
    def __init__(
        self,
        session_id: str,
        backend: Backend,
        on_folder: Callable[[], None],
        silence_timeout: float | None = None,
        idle_timeout: float | None = None,
        ttl: float | None = None,
    ):
        """on_folder(): called once the session's folder exists (before any worker starts).
        silence_timeout: the user's (seconds); None: the backend's (Capabilities.silence_timeout).
        idle_timeout, ttl: the user's (seconds; idle.py); None: none."""
        self.session_id = session_id
        self._silence_timeout = silence_timeout
        self._on_folder = on_folder
        self.backend = backend
        self.loop = LoopThread(name=f"cmlcluster-{session_id}")
        self.events = EventBus(f"cmlcluster-{session_id}")
        self.supervisor = Supervisor(session_id, backend, self.events, self.silence_timeout, idle_timeout, ttl)
        self.dir: str | None = None  # the session's folder (0700: the controller's keys), from the first launch
        self.logs = ""  # the folder of its workers' logs, kept after it (worker_logs.py), from the first launch
        self._attached = False  # whether the backend serves this session (from the first launch)

    @property
    def silence_timeout(self) -> float:
        """The silence (seconds) the session's agents, controller and backend allow a worker."""
        if self._silence_timeout is not None:
            return float(self._silence_timeout)
        return float(self.backend.capabilities().silence_timeout)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the loop for a sync caller; what it caused is shown before it returns."""
        try:
            return self.loop.run(coro)
        finally:
            self.events.drain(DRAIN_TIMEOUT)

    def read(self, read: Callable[[], T], closed: bool) -> T:
        """Read the records on the loop thread, where they change, so a reader never sees half a change."""
        if closed or self.loop.in_loop_thread:
            return read()  # nothing changes any more / already on the loop

        async def snapshot() -> T:
            return read()

        return self.loop.run(snapshot())

    async def launch(
        self,
        n: int,
        resources: Resources,
        kernel: str,
        program: Program,
        env: dict[str, str],
        cwd: str,
        replaces: str = "",
        collect: tuple[str, ...] = (),
        name: str = "",
    ) -> list[dict[str, Any]]:
        await self.backend.check(n, resources)
        control = await self._started()
        capabilities = self.backend.capabilities()
        specs = [
            build_spec(
                session_id=self.session_id,
                engine_id=self.supervisor.new_engine_id(),
                resources=resources,
                env=env,
                cwd=cwd,
                agent_env=control.agent_env(),
                controller_ip=self.backend.controller_ip(),
                capabilities=capabilities,
                replaces=replaces,
                collect=collect,
                name=name,
                app_ports=app_ports.pick(capabilities.own_address, capabilities.session_host),
            )
            for _ in range(n)
        ]
        return await self.supervisor.launch(specs, program, kernel)

    async def _started(self) -> ControlPlane:
        """The control plane, started: agent_env() is known; control.ready() says when it serves."""
        if self.supervisor.control is not None:
            return self.supervisor.control
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix=f"cmlcluster-{self.session_id}-")
            os.chmod(self.dir, 0o700)
            # Else in the session's folder, gone with it (said by session_folder).
            self.logs = worker_logs.session_folder(self.session_id) or os.path.join(self.dir, "workers")
            os.makedirs(self.logs, exist_ok=True)
            self._on_folder()
        # One silence for all three clocks: the agents' watchdogs, the controller's heartbeat misses
        # and the backend's own (ssh's keepalives).
        silence = self.supervisor.silence_timeout
        if not self._attached:
            await self.backend.attach(
                SessionContext(self.session_id, self.dir, silence_timeout=silence, logs=self.logs)
            )
            self._attached = True
        control = self.backend.control_plane() or IPyParallelControl(silence_timeout=silence)
        control.on_engine = self.supervisor.on_engine
        control.on_usage = self.supervisor.on_usage
        await control.start(self.backend.controller_ip(), self.dir)
        self.supervisor.use_control(control)
        return control

    async def wait(
        self, refs: list[str | Mapping[str, Any]], wait_for_completion: bool, timeout: float, fail_fast: bool
    ) -> waiting.AwaitResult:
        failures: list[dict[str, Any]] = []
        workers: list[Worker] = []
        for ref in refs:
            if isinstance(ref, Mapping) and "id" not in ref:
                failures.append(dict(ref))  # a launch that failed stays a failure
            else:
                workers.append(self.supervisor.resolve(ref))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        while not waiting.done_waiting(workers, wait_for_completion, fail_fast):
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                break
            await self.supervisor.changes.wait(remaining)
        last_output = self.supervisor.last_output_for_message
        return waiting.result(workers, failures, wait_for_completion, timeout, fail_fast, last_output)

    def close(self) -> None:
        try:
            self.loop.run(self._close(), timeout=CLOSE_TIMEOUT)
        finally:
            self.loop.stop()
            self.events.publish(SessionClosed(self.session_id))
            self.events.close()

    async def _close(self) -> None:
        # Each step runs even when one before it fails: a failing backend must not leave the
        # controller running or the session's folder (keys, logs) behind.
        steps = [self.supervisor.stop_everything, self.supervisor.cancel_tasks]
        if self.supervisor.control is not None:
            steps.append(self.supervisor.control.close)
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
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise errors[0]
