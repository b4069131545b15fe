"""One launch's workers as one Slurm job: the allocation that salloc asks for, and what salloc says of it.

backend.py makes a Gang for a launch of several workers alike (prepare_launch), starts each worker as a step
of it once Slurm grants it, lets a later launch take the places of its workers that ended, and cancels it when
the last of them ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ...errors import BackendError
from ...workers import Resources
from . import commands


@dataclass(eq=False)
class Gang:
    """One launch's workers as one Slurm job (salloc --no-shell): granted whole or not at all, each worker a
    step of it from then on. A later launch of workers alike takes the places of those that ended (an elastic
    job's replacement runs where its predecessor did, as torchrun's restarts do inside one sbatch job).
    Cancelled when the last of them ends."""

    name: str
    salloc: asyncio.subprocess.Process
    size: int  # its tasks: one worker's place each
    resources: Resources  # each task's
    members: set[str]
    job_id: str = ""
    granted: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    said: list[str] = field(default_factory=list)  # salloc's lines, for the message of a refusal
    reader: asyncio.Task[None] | None = None
    ended: bool = False

    async def follow_salloc(self, submitted: asyncio.Future[str]) -> None:
        """Follow salloc's words: the job's id once submitted, its grant (salloc then exits), or its refusal."""
        assert self.salloc.stderr is not None
        async for raw in self.salloc.stderr:
            line = raw.decode(errors="replace").strip()
            self.said.append(line)
            if (match := commands.SUBMITTED.search(line)) and not submitted.done():
                submitted.set_result(match.group(1))
            if (match := commands.GRANTED.search(line)) and not self.granted.done():
                self.granted.set_result(match.group(1))
        await self.salloc.wait()
        words = " ".join(line.removeprefix("salloc: ") for line in self.said) or f"exit code {self.salloc.returncode}"
        error = BackendError(f"Slurm did not grant the workers' job {self.job_id or self.name}: {words}")
        if not submitted.done():
            submitted.set_exception(error)
        if not self.granted.done():
            self.granted.set_exception(error)
            self.granted.exception()  # its workers each read it; none need be left when it comes
