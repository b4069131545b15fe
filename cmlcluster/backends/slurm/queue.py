"""What Slurm says of a session's jobs: one squeue for the whole session at most every POLL_SECONDS, on a
thread of its own, never one per worker (a cluster's controller serves every user of the site).

Each watched job's latest line is kept, and the queue ahead of the waiting ones; when a job's srun has
ended, settle() asks once more, for its last state (squeue keeps ended jobs for MinJobAge, 300 s by
default: no accounting, sacct, is needed).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping

from ...errors import BackendError
from . import commands

POLL_SECONDS = 2.0
SETTLE_SECONDS = 5.0  # how long an ended srun's job may take to show how it ended
COMMAND_TIMEOUT = 30.0  # a controller that does not answer within this fails the command

log = logging.getLogger(__name__)


def slurm_command(argv: list[str], env: Mapping[str, str]) -> str:
    """A Slurm command's output; BackendError with Slurm's own words when it fails."""
    try:
        ran = subprocess.run(
            argv, env=dict(env), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise BackendError(f"{argv[0]} had no answer from Slurm within {COMMAND_TIMEOUT:g} s") from None
    except OSError as e:
        raise BackendError(f"could not run {argv[0]}: {e}") from None
    if ran.returncode != 0:
        raise BackendError(f"{' '.join(argv[:2])} failed: {(ran.stderr or ran.stdout).strip()}")
    return ran.stdout


class JobQueue:
    """The session's jobs in Slurm's queue, by job name; and the session's steps of allocations (the one this
    process runs in, `allocation`, or its launches' gang jobs: follow_steps), by step name: their ids, for
    signalling one. Inside an allocation the session has no jobs of its own."""

    def __init__(
        self,
        env: Mapping[str, str],
        allocation: str = "",
        where: Callable[[list[str]], list[str]] = list,
    ):
        self._env = dict(env)
        self._where = where  # a command as run where Slurm's commands are (on a login node, over ssh)
        self._own_jobs = not allocation
        self._lock = threading.Lock()
        self._allocations: set[str] = {allocation} if allocation else set()  # whose steps are followed
        self._watched: set[str] = set()
        self._jobs: dict[str, commands.QueuedJob] = {}  # job name -> its latest line
        self._ahead: dict[str, int] = {}  # job name -> pending jobs before it in its partition
        self._steps: dict[str, str] = {}  # step name -> its id ("12.3")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cmlcluster-slurm-queue", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, name: str) -> None:
        with self._lock:
            self._watched.add(name)

    def unwatch(self, name: str) -> None:
        with self._lock:
            self._watched.discard(name)

    def follow_steps(self, job_id: str, following: bool = True) -> None:
        """Follow (or no longer) the session's steps of one of its jobs (a launch's gang job, once granted)."""
        with self._lock:
            if following:
                self._allocations.add(job_id)
            else:
                self._allocations.discard(job_id)

    def step(self, name: str) -> str | None:
        """The id of the session's step of the allocation named `name` ("12.3"), once squeue has shown it."""
        with self._lock:
            return self._steps.get(name)

    def last(self, name: str) -> commands.QueuedJob | None:
        with self._lock:
            return self._jobs.get(name)

    def waiting_reason(self, name: str) -> str | None:
        """Slurm's words for a job that waits (its state, reason and the jobs ahead); None for one that does not."""
        with self._lock:
            job = self._jobs.get(name)
            if job is None or job.state not in commands.WAITING:
                return None
            return commands.waiting_reason(job, self._ahead.get(name, 0))

    def settle(self, name: str, *, may_run_on: bool = False) -> None:
        """Ask for the last state of a job whose srun ended. Its step ends before its job: a cancelled job is
        COMPLETING for a moment before it is CANCELLED. may_run_on: the job holds other workers too (a
        launch's gang job), and running it is settled: the step ended on its own."""
        argv = ["squeue", "-h", "-t", "all", f"--name={name}", "-o", commands.SQUEUE_FORMAT]
        deadline = time.monotonic() + SETTLE_SECONDS
        with contextlib.suppress(BackendError):
            while self._own_jobs:  # a step has no state of its own in squeue: its srun's exit says it all
                jobs = commands.parse_squeue(slurm_command(self._where(argv), self._env))
                with self._lock:
                    self._jobs.update((job.name, job) for job in jobs)
                if all(job.state not in commands.NOT_ENDED for job in jobs) or time.monotonic() > deadline:
                    break
                if may_run_on and all(job.state == "RUNNING" for job in jobs):
                    break
                time.sleep(0.2)

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(COMMAND_TIMEOUT + 1)

    def _run(self) -> None:
        while not self._closed.wait(POLL_SECONDS):
            with self._lock:
                if not self._watched:
                    continue
            try:
                self._poll()
            except BackendError as e:  # the controller is busy or restarting: the next poll may answer
                log.debug("cmlcluster: squeue: %s", e)

    def _poll(self) -> None:
        if self._own_jobs:
            # Every pending job of the partitions, for the queue ahead of ours; our own in every state.
            argv = ["squeue", "-h", "-t", "all", "-o", commands.SQUEUE_FORMAT]
            queue = commands.parse_squeue(slurm_command(self._where(argv), self._env))
            with self._lock:
                for job in queue:
                    if job.name in self._watched:
                        self._jobs[job.name] = job
                        self._ahead[job.name] = commands.jobs_ahead(job, queue) if job.state == "PENDING" else 0
        with self._lock:
            allocations = sorted(self._allocations)
        if allocations:  # last: squeue refuses a list that names a job long gone (past MinJobAge)
            argv = ["squeue", "-h", "-s", "-j", ",".join(allocations), "-o", "%i|%j"]
            lines = [line.split("|") for line in slurm_command(self._where(argv), self._env).splitlines()]
            with self._lock:
                self._steps.update((line[1], line[0]) for line in lines if len(line) == 2 and line[1] in self._watched)
