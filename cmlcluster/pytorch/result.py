"""What a PyTorch run returns (TorchResult), and raises with it (TorchError)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..events import JobFailure
from ..jobs import JobFailed
from ..runs import RunError, RunResult


@dataclass(frozen=True)
class RankFailure:
    """The process that failed first: its global and local rank, node, exit code, and why."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    exit_code: int
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        where = f"local rank {self.local_rank} on node {self.node_rank}, {self.host}"
        return f"rank {self.rank} ({where}) exited with code {self.exit_code}: {self.message}"


@dataclass
class TorchResult(RunResult):
    """What a PyTorch run did: its exit code, every rank's output, which rank failed and why."""

    exit_code: int
    nnodes: int
    nproc_per_node: int
    hosts: list[str]  # each node's address, node 0 first (a lost one's replacement in its place)
    master: str  # the rendezvous endpoint, address:port (the session's, for an elastic run)
    duration: float  # seconds from the workers running to the end of the run
    output: dict[int, list[str]] = field(default_factory=dict)  # rank -> its last lines
    node_exit_codes: dict[int, int] = field(default_factory=dict)  # node (its index in the job) -> torchrun's exit code
    failure: RankFailure | None = None
    worker_failure: JobFailure | None = None  # a worker that ended during the run (killed, crashed)
    value: Any = None  # rank 0's return value, for a function
    restarts: int = 0  # workers lost and replaced (max_restarts)

    @property
    def failed_rank(self) -> int | None:
        return self.failure.rank if self.failure is not None else None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def __repr__(self) -> str:
        state = "ok" if self.ok else "failed" + (f" (rank {self.failed_rank})" if self.failure else "")
        restarts = f" restarts={self.restarts}" if self.restarts else ""
        return (
            f"<TorchResult {state} exit_code={self.exit_code} ranks={self.world_size} nodes={self.nnodes}{restarts} "
            f"{self.duration:.1f} s master={self.master}>"
        )

    @property
    def message(self) -> str:
        if self.ok:
            return f"torchrun succeeded: {self.world_size} processes on {self.nnodes} nodes"
        if self.failure is not None:
            details = self.failure.traceback.rstrip() or "\n".join(self.output.get(self.failure.rank, [])[-20:])
            return f"{self.failure}; every other process was stopped.\n{details}".rstrip()
        if self.worker_failure is not None:
            if self.restarts:  # the job layer's words: "failed after N restarts"
                return f"the {JobFailed('PyTorch job', self.worker_failure, self.restarts)}"
            return f"the PyTorch job failed: {self.worker_failure}; every other worker was stopped"
        codes = ", ".join(f"node {n}: {c}" for n, c in sorted(self.node_exit_codes.items()))
        return f"the PyTorch job failed (torchrun exit codes: {codes or 'none'})"


class TorchError(RunError):
    """run_torch(check=True) failed; `result` is its TorchResult."""
