"""Workers that sit idle, stopped: a session's idle_timeout= (dstack's idle duration, for workers) and ttl=.

A worker counts as idle while the samples its agent sends (usage.py: every 2 s by default) show its whole
process tree under IDLE_CPU_PERCENT of one core and each of its GPUs under IDLE_GPU_PERCENT busy. Once it
has been idle for idle_timeout seconds the session stops it, its message saying why; from the last
COUNTDOWN_SHARE of that time on, its message counts down (the views show it in the worker's row, where a
scheduler's reason stands while one waits). A sample that shows work sets its clock back to zero. A worker
whose samples do not come (sampling turned off with CMLCLUSTER_USAGE_SECONDS=0) is never idle.

ttl: every worker of the session is stopped that long after its first launch, busy or not, and the session
launches no more: a budget, for a notebook left running over a weekend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import ResourceUse

IDLE_CPU_PERCENT = 5.0  # of one core: an agent that only samples and pings uses about 1 %
IDLE_GPU_PERCENT = 5.0
COUNTDOWN_SHARE = 0.5  # of idle_timeout: the part before its end in which its message counts down
IDLE_MARK = "idle for "  # how every message of this module begins: another's is left alone


def is_idle(use: ResourceUse) -> bool:
    return use.cpu_percent < IDLE_CPU_PERCENT and all(g.utilization_percent < IDLE_GPU_PERCENT for g in use.gpus)


@dataclass
class IdleClock:
    """Since when each worker has been idle, from its samples; one per session (the supervisor's)."""

    idle_timeout: float
    _idle_since: dict[str, float] = field(default_factory=dict)

    def sample(self, worker_id: str, use: ResourceUse, now: float) -> None:
        if is_idle(use):
            self._idle_since.setdefault(worker_id, now)
        else:
            self._idle_since.pop(worker_id, None)

    def forget(self, worker_id: str) -> None:
        self._idle_since.pop(worker_id, None)

    def idle_for(self, worker_id: str, now: float) -> float | None:
        """Seconds the worker has been idle; None while it works (or before its first sample)."""
        since = self._idle_since.get(worker_id)
        return None if since is None else now - since

    def message(self, worker_id: str, now: float) -> str | None:
        """What its row says now: a countdown in the last part of idle_timeout, then why it is stopped;
        None while it works or is not near its end."""
        idle = self.idle_for(worker_id, now)
        if idle is None or idle < self.idle_timeout * (1 - COUNTDOWN_SHARE):
            return None
        cause = f"{IDLE_MARK}{idle:.0f} s (idle_timeout={self.idle_timeout:g} s)"
        if idle >= self.idle_timeout:
            return f"stopped: {cause}: under {IDLE_CPU_PERCENT:g} % of a core and no GPU busy"
        return f"{cause}: stopped in {self.idle_timeout - idle:.0f} s unless it works"

    def expired(self, worker_id: str, now: float) -> bool:
        idle = self.idle_for(worker_id, now)
        return idle is not None and idle >= self.idle_timeout


def ttl_message(ttl: float) -> str:
    return f"stopped: the session's ttl ({ttl:g} s since its first launch) ran out"
