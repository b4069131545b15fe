"""Files a worker leaves in a working folder of its own, said once before they go with it.

On backends whose workers do not see the session's working folder (SSH hosts, pods, Docker without it
mounted), a worker starts in a folder of its own, removed when it ends (ssh/remote.py's rmtree, the
end of a container or a pod). What its program saved there by a relative name (model.keras,
./checkpoints/) would go without a word. So before the session stops such a worker, it asks the
worker's agent what the folder holds besides the files shipped to it (agent_files.leftovers) and says
it at WARNING, once per worker, naming a few entries and their size. A worker busy running code (a
program, a call) answers nothing until that ends: the session does not wait for it; a program the stop
interrupts says it in its own output instead (agent_program). One that died has no agent left to ask.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from .agent.files import notice
from .supervision import WorkerCalls
from .workers import RUNNING, Worker

log = logging.getLogger(__name__)

ASK_TIMEOUT = 2.0  # seconds: an idle agent answers in one round trip; a stop never waits long on one


class Leftovers:
    """The leftovers of one session's workers, asked once each (a supervisor's part)."""

    def __init__(self, supervisor: WorkerCalls):
        self._supervisor = supervisor
        self.busy: collections.Counter[str] = collections.Counter()  # calls running in each worker
        self._asked: set[str] = set()

    def _may_ask(self, worker: Worker) -> bool:
        """An idle worker, in a folder of its own, with its agent there and not asked yet."""
        program = self._supervisor.program(worker.id)
        return (
            worker.status == RUNNING
            and worker.id not in self._asked
            and not self.busy[worker.id]
            and (program is None or program.done())
            and not self._supervisor.backend.capabilities().sees(worker.spec.cwd)
        )

    async def before_stop(self, workers: list[Worker]) -> None:
        """Say what each of these workers leaves, before they are stopped (at most ASK_TIMEOUT s)."""
        asked = [w for w in workers if self._may_ask(w)]
        self._asked.update(w.id for w in asked)
        found = await asyncio.gather(*(self._ask(w) for w in asked))
        for worker, leftovers in zip(asked, found, strict=True):
            if leftovers:
                log.warning("cmlcluster: %s", notice(worker.id, leftovers))

    async def _ask(self, worker: Worker) -> dict[str, Any] | None:
        try:
            found = await self._supervisor.call(worker, "cmlcluster.agent.main:leftovers", (), ASK_TIMEOUT)
        except Exception as e:  # an agent of an older cmlcluster, a worker ending meanwhile: nothing to say
            log.debug("cmlcluster: could not ask worker %s what its folder holds: %s", worker.id, e)
            return None
        return found if isinstance(found, dict) and found.get("files") else None
