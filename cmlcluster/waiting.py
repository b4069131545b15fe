"""Waiting for workers: one change notifier, and the shape of what await_workers returns.

Every coroutine that waits for a worker's status (await_workers, a call into a worker)
waits on the same notifier, woken by the supervisor whenever a status changes: nothing
polls. The result of a wait is a pure function of the workers' records.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .workers import FAILED, RUNNING, STOPPED, SUCCEEDED, TIMEDOUT, Worker, WorkerSnapshot


class Changes:
    """Wakes whoever waits for the next change of any worker's status. The session's loop only."""

    def __init__(self) -> None:
        # A dict (ordered, as a list was) so that forget() costs the same however many wait: each of a
        # call_each's N calls waits here, and a list's remove made its N forgets O(N^2).
        self._waiters: dict[asyncio.Future[None], None] = {}

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def next(self) -> asyncio.Future[None]:
        """A future done at the next change; forget() it if you stop waiting first."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[waiter] = None
        return waiter

    def forget(self, waiter: asyncio.Future[None]) -> None:
        self._waiters.pop(waiter, None)

    async def wait(self, timeout: float | None) -> None:
        """Until the next change, or `timeout` seconds (None: no limit)."""
        waiter = self.next()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(waiter, timeout)
        self.forget(waiter)


def decided(worker: Worker, wait_for_completion: bool) -> bool:
    """Whether waiting for this worker is over: it finished, or it runs and that is all we wait for."""
    return worker.finished or (not wait_for_completion and worker.status == RUNNING)


def one_failed(workers: Iterable[Worker], fail_fast: bool) -> bool:
    return fail_fast and any(w.status in (FAILED, STOPPED) for w in workers)


def done_waiting(workers: list[Worker], wait_for_completion: bool, fail_fast: bool) -> bool:
    return all(decided(w, wait_for_completion) for w in workers) or one_failed(workers, fail_fast)


@dataclass(frozen=True)
class AwaitResult:
    """What a wait for workers found: the workers where the caller wanted them (running, or succeeded),
    and the others, each with why (a worker not there by the deadline has status TIMEDOUT), after the
    launches that had failed before the wait (CML's dicts: no worker was made). to_dict() is CML's."""

    workers: tuple[WorkerSnapshot, ...]
    failures: tuple[WorkerSnapshot, ...]
    failed_launches: tuple[Mapping[str, Any], ...] = ()

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        """CML's {"workers": [...], "failures": [...]}."""
        failures = [dict(f) for f in self.failed_launches] + [w.to_dict() for w in self.failures]
        return {"workers": [w.to_dict() for w in self.workers], "failures": failures}


def result(
    workers: list[Worker],
    failed_launches: list[dict[str, Any]],
    wait_for_completion: bool,
    timeout: float,
    fail_fast: bool,
    last_output: Callable[[Worker], str] = lambda worker: "",
) -> AwaitResult:
    """What the wait found, once it is over (or its time is up).

    `failed_launches` are launches that failed before the wait (no worker was made); `last_output(worker)`
    ends the message of one still starting when the time was up (what it was doing then: its agent's last
    lines).
    """
    ok: list[WorkerSnapshot] = []
    failures: list[WorkerSnapshot] = []
    wanted = SUCCEEDED if wait_for_completion else RUNNING
    another_failed = one_failed(workers, fail_fast)
    for w in workers:
        snapshot = w.snapshot()
        if w.status == wanted:
            ok.append(snapshot)
            continue
        if not decided(w, wait_for_completion) and another_failed:
            snapshot = replace(snapshot, message=f"worker {w.id} was still {w.status} when another worker failed")
        elif not decided(w, wait_for_completion):
            message = f"worker {w.id} was still {w.status} after {timeout:g} s{last_output(w)}"
            snapshot = replace(snapshot, status=TIMEDOUT, message=message)
        elif not wait_for_completion and not snapshot.message:
            snapshot = replace(snapshot, message=f"worker {w.id} {w.status} while waiting for it to run")
        failures.append(snapshot)
    return AwaitResult(tuple(ok), tuple(failures), tuple(failed_launches))
