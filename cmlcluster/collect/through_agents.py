"""collect= where the backend cannot take a worker's files itself (pods): the session takes them from the
worker's agent over the control plane (collect/in_worker.py) before it stops the worker.

- A program that ends (success or failure): its files are taken before the worker is stopped, so a
  worker reported ended has them in the session's working folder, as on the other backends.
- A stop while the program runs: the program is interrupted through the control plane first
  (ControlPlane.interrupt: it ends as a stop's signal ends it, its finally blocks run, and the agent
  keeps serving), then its files are taken, then the worker is stopped.
- A worker killed outright (out of memory, its node lost, kill -9) has no agent left to ask: its files
  are gone with it, and a warning says so. Backends that take files themselves (Capabilities.collects:
  SSH hosts keep them aside, Docker copies them out of the stopped container) have them even then.

The files travel as one tar stream, CHUNK bytes per call, into results_home's Homecoming: the same
rules (only what collect= asks for, changed files only, no links, never over a file that was there, the
caps, two workers' same file) as on every other backend. The agent's answers are a worker's word: its
report is read for its shape (results_home.checked_report), and the session reads at most the caps'
worth of its stream, whatever size it claims, and of each chunk no more than it asked for, as bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from ..supervision import WorkerCalls
from ..workers import RUNNING, Worker
from . import paths as results
from .home import Arrival, Homecoming, checked_report

log = logging.getLogger(__name__)

AGENT = "cmlcluster.collect.in_worker"
PACK_TIMEOUT = 120.0  # seconds to move and write up to the cap (1 GiB) on the worker's disk
CHUNK = 4 << 20  # bytes per call: a reply of this size is one message on the control plane
CHUNK_TIMEOUT = 60.0
INTERRUPTED_WAIT = 10.0  # seconds for an interrupted program to end (its finally blocks run)


def _most(cap: int, cap_files: int) -> int:
    """The most bytes an honest agent's tar file of at most these caps holds: the files, and per file a
    header with PAX records (its name, times) and padding."""
    return cap + cap_files * 8 * 1024 + 10 * 1024


class CollectThroughAgents:
    """One session's workers whose collect= files come home through their agents (a supervisor's part)."""

    def __init__(self, supervisor: WorkerCalls):
        self._supervisor = supervisor
        self._taking: dict[str, asyncio.Future[None]] = {}
        self._given_up: set[str] = set()  # workers whose files were said lost before they were asked for

    def applies(self, worker: Worker) -> bool:
        """Whether this worker's files come home through its agent: it has collect= paths, works in a
        folder of its own, and its backend does not take them itself."""
        capabilities = self._supervisor.backend.capabilities()
        return bool(worker.spec.collect) and not capabilities.collects and not capabilities.sees(worker.spec.cwd)

    async def before_stop(self, workers: list[Worker]) -> None:
        """Before these workers are stopped: the running programs of those whose files come home here
        interrupted, and their files taken."""
        await asyncio.gather(*(self._interrupt_then_take(w) for w in workers if self.applies(w)))

    async def _interrupt_then_take(self, worker: Worker) -> None:
        program = self._supervisor.program(worker.id)
        if program is not None and not program.done():
            try:
                await self._supervisor.interrupt(worker)
            except Exception as e:
                self._give_up(worker, f"its agent did not take the interrupt: {e}")
                return
            await asyncio.wait([program], timeout=INTERRUPTED_WAIT)
            if not program.done():
                self._give_up(worker, f"its program did not end within {INTERRUPTED_WAIT:g} s of being interrupted")
                return
        await self.take(worker)

    async def take(self, worker: Worker) -> None:
        """Bring the worker's files home, once (a program's end and a stop both ask); a caller
        cancelled meanwhile does not cancel it for the other."""
        if not self.applies(worker):
            return
        if worker.id not in self._taking:
            self._taking[worker.id] = asyncio.ensure_future(self._take(worker))
        await asyncio.shield(self._taking[worker.id])

    def ended_untaken(self, worker: Worker) -> None:
        """The worker's process is gone: said if its files never came home (its agent went with it)."""
        ran = worker.running_at is not None
        if ran and self.applies(worker) and worker.id not in self._taking and worker.id not in self._given_up:
            self._give_up(worker, "it ended before its agent could send them")

    async def _take(self, worker: Worker) -> None:
        supervisor = self._supervisor
        if worker.status != RUNNING:
            log.warning("cmlcluster: %s", self._gone(worker, f"it was {worker.status} before they were asked for"))
            return
        try:
            caps = (results.cap_bytes(), results.cap_files())
            answer = await supervisor.call(worker, f"{AGENT}:pack", (worker.id, *caps), PACK_TIMEOUT)
        except Exception as e:
            log.warning("cmlcluster: %s", self._gone(worker, str(e)))
            return
        report = checked_report(answer, worker.id)
        if not report.get("kept"):
            why = report.get("why", "nothing was kept")
            log.warning("cmlcluster: worker %s's collect= files did not come home (%s)", worker.id, why)
            return
        arrival = Arrival(worker.id, worker.spec.cwd, worker.spec.collect)
        broke: list[Exception] = []
        size = min(report.get("size", 0), _most(results.cap_bytes(), results.cap_files()))
        chunks = self._chunks(worker, size, asyncio.get_running_loop(), broke)
        await asyncio.to_thread(Homecoming.of(supervisor.backend.context).unpack, chunks, arrival)
        try:
            await supervisor.call(worker, f"{AGENT}:drop", (worker.id,), CHUNK_TIMEOUT)
        except Exception as e:  # it goes with the worker's temp folder anyway
            log.debug("cmlcluster: worker %s kept its packed files: %s", worker.id, e)
        if broke:
            arrival.stay(f"the rest (the transfer broke off: {broke[0]})")
        arrival.say(report)

    def _chunks(
        self, worker: Worker, size: int, loop: asyncio.AbstractEventLoop, broke: list[Exception]
    ) -> Iterator[bytes]:
        """The packed files, CHUNK bytes per call (on the unpacking thread: each call runs on the loop)."""
        offset = 0
        while offset < size:
            call = self._supervisor.call(worker, f"{AGENT}:chunk", (worker.id, offset, CHUNK), CHUNK_TIMEOUT)
            try:
                data: Any = asyncio.run_coroutine_threadsafe(call, loop).result()
            except Exception as e:
                broke.append(e)
                return
            if not isinstance(data, (bytes, bytearray)):
                broke.append(TypeError(f"its agent sent {_a(type(data).__name__)}, not bytes"))
                return
            if not data:
                return
            data = data[: min(CHUNK, size - offset)]  # never more than asked for
            offset += len(data)
            yield bytes(data)

    def _give_up(self, worker: Worker, why: str) -> None:
        self._given_up.add(worker.id)
        log.warning("cmlcluster: %s", self._gone(worker, why))

    def _gone(self, worker: Worker, why: str) -> str:
        return (
            f"worker {worker.id}'s collect= files did not come home: {why}. On the "
            f"{self._supervisor.backend.name} backend they come home through the worker's agent when its "
            "program ends or is stopped; a worker killed outright (out of memory, its node lost) takes them "
            "with it: save what must survive that to a shared volume"
        )


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"
