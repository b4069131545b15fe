"""What a Horovod run did (HorovodResult), and the error check=True raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..events import JobFailure
from ..jobs import JobFailed
from ..runs.result import RunError, RunResult


@dataclass
class HorovodResult(RunResult):
    """What a Horovod run did: its exit code, every rank's output, which rank failed and why."""

    exit_code: int
    hosts: list[tuple[str, int]]
    argv: list[str]
    duration: float
    output: dict[int, list[str]] = field(default_factory=dict)  # rank -> lines
    driver_output: list[str] = field(default_factory=list)  # horovodrun's own lines
    rank_exit_codes: dict[int, int] = field(default_factory=dict)  # non-zero ones horovodrun reported
    failed_rank: int | None = None
    worker_failure: JobFailure | None = None  # a worker that ended during the run (killed, crashed)
    restarts: int = 0  # elastic runs: workers replaced, or (on this machine) ranks horovodrun started again

    def __repr__(self) -> str:
        ranks = len(self.output)
        state = "ok" if self.ok else f"failed (rank {self.failed_rank})"
        restarts = f" restarts={self.restarts}" if self.restarts else ""
        return (
            f"<HorovodResult {state} exit_code={self.exit_code} ranks={ranks}{restarts} {self.duration:.1f} s "
            f"hosts={self.hosts}>"
        )

    @property
    def message(self) -> str:
        if self.ok:
            return f"horovodrun succeeded: {sum(s for _, s in self.hosts)} slots on {len(self.hosts)} hosts"
        if self.worker_failure is not None and self.restarts:  # the job layer's words: "failed after N restarts"
            return f"the {JobFailed('Horovod job', self.worker_failure, self.restarts)}"
        if self.worker_failure is not None:
            return (
                f"the Horovod job failed: {self.worker_failure}; horovodrun, its ranks and every other worker "
                "were stopped"
            )
        if self.failed_rank is None:
            tail = "\n".join(self.driver_output[-20:])
            return f"horovodrun exited with code {self.exit_code}:\n{tail}"
        code = self.rank_exit_codes.get(self.failed_rank)
        tail = "\n".join(self.output.get(self.failed_rank, [])[-20:])
        return (
            f"rank {self.failed_rank} exited with code {code}; horovodrun stopped the other ranks. "
            f"Its last output:\n{tail}"
        )


class HorovodError(RunError):
    """run_horovod(check=True) failed; `result` is its HorovodResult."""
