"""The straggler watch (cmlcluster/stragglers.py) on fake report streams: a reporter more than the fraction
slower than its peers' median over the window is flagged once, and again when it catches up; one that
stopped reporting falls to 0; warm-up, lone reporters and other kinds are left alone; bad settings are
refused before anything starts. Real workers' reports: tests/integration/test_stragglers.py."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError, Session
from cmlcluster.events import GpuUse, Progress, ResourceUse, Straggler
from cmlcluster.stragglers import StragglerWatch, peer_kind


def feed(watch: StragglerWatch, paces: dict[str, float], seconds: int, start: int = 0) -> list[Straggler]:
    """Each task reports once a second at its pace (steps a second) from `start` on; the flags raised."""
    flags = []
    for t in range(start, start + seconds):
        for task, pace in paces.items():
            if pace >= 0:
                flags += watch.sample(Progress(task, step=t * pace, time=float(t), worker=f"w{task[-1]}"))
    return flags


def test_a_rank_slower_than_the_fraction_of_the_median_is_flagged_once_and_again_when_it_catches_up():
    watch = StragglerWatch(fraction=0.3, window=10)
    assert feed(watch, {"rank 0": 2.0, "rank 1": 2.0, "rank 2": 1.0}, 10) == []  # no full window yet
    [flag] = feed(watch, {"rank 0": 2.0, "rank 1": 2.0, "rank 2": 1.0}, 5, start=10)
    assert (flag.task, flag.worker, flag.peers, flag.over) == ("rank 2", "w2", "rank", False)
    # Judged as rank 0 reports at t=10, rank 2's last report at t=9: 9 steps in 10 s; the median is rank 1's.
    assert (flag.rate, flag.median) == (0.9, 1.8)
    assert flag.message() == (
        "rank 2 is a straggler: 50% slower than the ranks' median (0.9 steps/s against 1.8, over 10 s); "
        "the X-ray shows where it stands"
    )
    assert feed(watch, {"rank 0": 2.0, "rank 1": 2.0, "rank 2": 1.0}, 5, start=15) == []  # said once
    # It catches up: its steps over the window come at its peers' pace again.
    flags = []
    step = 20.0
    for t in range(20, 40):
        step += 2.0
        flags += watch.sample(Progress("rank 2", step=step, time=float(t)))
        flags += watch.sample(Progress("rank 0", step=2.0 * t, time=float(t)))
        flags += watch.sample(Progress("rank 1", step=2.0 * t, time=float(t)))
    assert [(f.task, f.over) for f in flags] == [("rank 2", True)]
    assert flags[0].message().startswith("rank 2 keeps pace again")


def test_within_the_fraction_nobody_is_flagged():
    assert feed(StragglerWatch(fraction=0.3, window=10), {"rank 0": 2.0, "rank 1": 1.5, "rank 2": 2.1}, 30) == []


def test_a_rank_that_stopped_reporting_falls_to_zero_and_is_flagged():
    watch = StragglerWatch(fraction=0.3, window=10)
    feed(watch, {"rank 0": 1.0, "rank 1": 1.0}, 12)
    flags = feed(watch, {"rank 0": 1.0, "rank 1": -1}, 11, start=12)  # rank 1 is silent from t=12 on
    # Flagged once, as its pace over the window falls below 70 % of the median (two peers: their mean).
    [flag] = flags
    assert flag.task == "rank 1" and flag.rate < 0.7 * flag.median


def test_only_peers_of_one_kind_are_compared_and_a_lone_reporter_never():
    watch = StragglerWatch(fraction=0.3, window=10)
    assert feed(watch, {"rank 0": 5.0, "worker 0": 1.0, "coordinator": 0.1}, 30) == []
    assert (peer_kind("rank 12"), peer_kind("worker 3"), peer_kind("coordinator")) == ("rank", "worker", None)


def test_a_restart_from_a_checkpoint_starts_a_new_history():
    watch = StragglerWatch(fraction=0.3, window=10)
    feed(watch, {"rank 0": 1.0, "rank 1": 1.0}, 20)
    # rank 1 restarts at step 0: its new history needs a whole window before it is judged again.
    assert watch.sample(Progress("rank 1", step=0, time=20.0)) == []
    assert feed(watch, {"rank 0": 1.0}, 5, start=21) == []


def test_the_message_carries_what_the_worker_uses():
    flag = Straggler("rank 2", "w1", 0.5, 2.0, "rank", 0.3, 30.0)
    use = ResourceUse("w1", 99.0, 1 << 30, None, (GpuUse(0, 97.0, 0, 1 << 30),))
    assert flag.message(use) == (
        "rank 2 is a straggler: 75% slower than the ranks' median (0.5 steps/s against 2, over 30 s); its worker "
        "uses 99 % CPU, GPU 0 97 % busy; the X-ray shows where it stands"
    )


@pytest.mark.parametrize(
    "options, refused",
    [
        ({"straggler_fraction": 1.5}, "straggler_fraction=1.5: give the share"),
        ({"straggler_fraction": "0.3"}, "straggler_fraction='0.3'"),
        ({"straggler_window": 0.5}, "straggler_window=0.5: give the seconds"),
        ({"straggler_window": True}, "straggler_window=True"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(options, refused):
    with pytest.raises(ConfigError, match=refused.replace("(", r"\(")):
        Session("fake", echo=False, **options)
