"""What every run returns and raises: RunResult (and NodesResult, the result of a run of one node per
worker), RunError, and RankFailure, the process that failed first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CmlClusterError
from ..jobs import JobFailed

if TYPE_CHECKING:
    from ..events import JobFailure

RESULT_LINES_KEPT = 10_000  # per rank, in a run's result (a run may print for hours)


class RunResult:
    """What a run did. Every kind has these; each adds what its framework knows (hosts, the master).

    exit_code: 0 when every rank succeeded. output: each rank's last lines. duration: seconds of
    the run. worker_failure: the worker that ended during the run (killed, crashed), if one did.
    failed_rank: the rank that failed first, when a rank did. message: what happened, in a sentence.
    """

    exit_code: int
    duration: float
    output: dict[int, list[str]]
    worker_failure: JobFailure | None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def message(self) -> str:
        raise NotImplementedError


class RunError(CmlClusterError):
    """A run failed (check=True): `result` says how."""

    def __init__(self, result: RunResult):
        super().__init__(result.message)
        self.result = result


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
class NodesResult(RunResult):
    """What a run of one node per worker did (run_torch, run_jax, run_accelerate): its exit code, every
    rank's output, which rank failed and why. Each framework's kind names its launcher and job."""

    exit_code: int
    nnodes: int
    nproc_per_node: int
    hosts: list[str]  # each node's address, node 0 first (a lost one's replacement in its place)
    master: str  # the rendezvous endpoint, address:port (the session's, for an elastic run)
    duration: float  # seconds from the workers running to the end of the run
    output: dict[int, list[str]] = field(default_factory=dict)  # rank -> its last lines
    node_exit_codes: dict[int, int] = field(default_factory=dict)  # node (its index in the job) -> its exit code
    failure: RankFailure | None = None
    worker_failure: JobFailure | None = None  # a worker that ended during the run (killed, crashed)
    value: Any = None  # rank 0's return value, for a function
    restarts: int = 0  # workers lost and replaced (max_restarts)

    launcher = "the launcher"  # what each node runs, in messages ("torchrun")
    job = "job"  # the job's name in messages ("PyTorch job")

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
            f"<{type(self).__name__} {state} exit_code={self.exit_code} ranks={self.world_size} nodes={self.nnodes}"
            f"{restarts} {self.duration:.1f} s master={self.master}>"
        )

    @property
    def message(self) -> str:
        if self.ok:
            return f"{self.launcher} succeeded: {self.world_size} processes on {self.nnodes} nodes"
        if self.failure is not None:
            details = self.failure.traceback.rstrip() or "\n".join(self.output.get(self.failure.rank, [])[-20:])
            return f"{self.failure}; every other process was stopped.\n{details}".rstrip()
        if self.worker_failure is not None:
            if self.restarts:  # the job layer's words: "failed after N restarts"
                return f"the {JobFailed(self.job, self.worker_failure, self.restarts)}"
            return f"the {self.job} failed: {self.worker_failure}; every other worker was stopped"
        codes = ", ".join(f"node {n}: {c}" for n, c in sorted(self.node_exit_codes.items()))
        return f"the {self.job} failed ({self.launcher} exit codes: {codes or 'none'})"
