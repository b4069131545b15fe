"""What the supervisor's parts (leftovers, collect.through_agents) may do with a session's workers: call a
function in a worker's agent, see its program, interrupt that program as a stop does. A narrow protocol: they
read and write nothing else of the Supervisor, whose state is its own."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .backends import Backend
from .workers import Worker


class WorkerCalls(Protocol):
    @property
    def backend(self) -> Backend: ...

    async def call(self, worker: Worker, target: str, args: tuple[Any, ...], timeout: float | None) -> Any:
        """`target` ("module:function") called in the worker's agent with `args`; its value."""

    def program(self, worker_id: str) -> asyncio.Future[Any] | None:
        """The worker's program, running or ended; None before one was run."""

    async def interrupt(self, worker: Worker) -> None:
        """End the worker's running program as a stop does (its end is then a stop's), its agent serving on."""
