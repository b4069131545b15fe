"""A worker's end is reported once all of its output is in the session (issue 21), on the fake backend.

Its output comes two ways: what its process writes (the backend's output(), complete once wait()
returns) and what its program prints (over the control plane, which can trail the process's end).
"""

from __future__ import annotations

import time

from cmlcluster import Session
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.supervisor import EXIT_OUTPUT_GRACE


def told(events):
    """Output lines and statuses, in the order the subscribers heard them."""
    return [e.text if e.kind == "output" else e.worker.status for e in events if e.kind in ("output", "status")]


def test_a_stopped_program_s_cleanup_output_comes_before_its_end():
    # The stop ends the program through its cleanup, whose lines (and the program's result) reach the
    # session 0.3 s after the backend has seen the process go: "stopped" waits for them.
    plan = FakeWorker(output=("training",), run_time=60, cleanup_output=("saved a checkpoint",), cleanup_delay=0.3)
    with Session(FakeBackend([plan]), echo=False) as s:
        events = []
        s.subscribe(events.append)
        [w] = s.launch_workers(1, cpu=1, memory=1, code="train()")
        assert s.await_workers([w], wait_for_completion=False, timeout_seconds=10)["failures"] == []
        [stopped] = s.stop_workers(w)
        assert (stopped["status"], stopped["exit_code"]) == ("stopped", -15)
        assert s.output(w) == "training\nsaved a checkpoint"
        s.drain()
    assert told(events)[-2:] == ["saved a checkpoint", "stopped"]


def test_an_end_waits_for_late_program_output_only_so_long():
    # A program whose engine dies with it never says how it ended: its end is reported all the same,
    # EXIT_OUTPUT_GRACE after its process went at the latest (here the news would take 60 s).
    plan = FakeWorker(run_time=60, cleanup_output=("never in time",), cleanup_delay=60)
    with Session(FakeBackend([plan]), echo=False) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="train()")
        assert s.await_workers([w], wait_for_completion=False, timeout_seconds=10)["failures"] == []
        began = time.monotonic()
        [stopped] = s.stop_workers(w)
        assert time.monotonic() - began < EXIT_OUTPUT_GRACE + 1
        assert (stopped["status"], stopped["exit_code"]) == ("stopped", -15)
        assert s.output(w) == ""
