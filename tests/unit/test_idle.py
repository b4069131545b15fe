"""The idle clock (cmlcluster/idle.py) on fake load patterns: a worker under the thresholds for
idle_timeout is due to stop, work sets its clock back, a busy GPU is work, the countdown comes in the last
half."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError, Session
from cmlcluster.events import GpuUse, ResourceUse
from cmlcluster.idle import IDLE_MARK, IdleClock, is_idle


def use(cpu: float, *gpus: float) -> ResourceUse:
    return ResourceUse(
        "w", cpu, 1 << 20, None, tuple(GpuUse(i, busy, 0, 1 << 30) for i, busy in enumerate(gpus)), time=0.0
    )


def test_idle_means_under_a_twentieth_of_a_core_and_no_gpu_busy():
    assert is_idle(use(0.8)) and is_idle(use(4.9, 0.0, 3.0))
    assert not is_idle(use(5.0)) and not is_idle(use(250.0))
    assert not is_idle(use(0.5, 0.0, 80.0))  # a GPU that trains, its host's CPU quiet: busy


def test_a_steady_idle_worker_counts_down_in_the_last_half_then_is_due():
    clock = IdleClock(idle_timeout=60)
    for t in range(0, 62, 2):  # a sample every 2 s
        clock.sample("w", use(1.0), float(t))
    assert clock.idle_for("w", 28.0) == 28.0 and clock.message("w", 28.0) is None  # not near its end
    assert clock.message("w", 40.0) == "idle for 40 s (idle_timeout=60 s): stopped in 20 s unless it works"
    assert clock.message("w", 40.0).startswith(IDLE_MARK)
    assert not clock.expired("w", 59.0) and clock.expired("w", 60.0)
    assert clock.message("w", 60.0) == "stopped: idle for 60 s (idle_timeout=60 s): under 5 % of a core and no GPU busy"


def test_a_burst_of_work_sets_the_clock_back_and_a_worker_without_samples_is_never_idle():
    clock = IdleClock(idle_timeout=10)
    pattern = [1.0] * 4 + [90.0] + [1.0] * 4  # 8 s idle, a burst, 8 s idle again: never 10 s in a row
    for i, cpu in enumerate(pattern):
        clock.sample("w", use(cpu), 2.0 * i)
    assert clock.idle_for("w", 16.0) == 6.0 and not clock.expired("w", 16.0)
    assert clock.idle_for("other", 100.0) is None and not clock.expired("other", 100.0)
    clock.forget("w")
    assert clock.idle_for("w", 16.0) is None


@pytest.mark.parametrize("option", ["idle_timeout", "ttl"])
@pytest.mark.parametrize("value", [0, 0.5, -3, float("nan"), "60", True])
def test_a_bad_idle_timeout_or_ttl_is_refused_before_anything_starts(option, value):
    with pytest.raises(ConfigError, match=rf"^{option}={value!r}: give a number of seconds >= 1"):
        Session("local", echo=False, **{option: value})
