"""A wait for workers, typed inside (waiting.AwaitResult: snapshots) and CML's dicts at the edge
(await_workers): who is where the caller wanted, and why each other one is not."""

from __future__ import annotations

from cmlcluster import Session
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.workers import Status, WorkerSnapshot


def test_a_wait_says_who_ran_who_failed_and_who_timed_out_and_cmls_dict_says_the_same():
    plan = [FakeWorker(), FakeWorker(registers=False), FakeWorker(launch_error="no room")]
    with Session(FakeBackend(plan), echo=False) as session:
        launched = session.launch_workers(3, cpu=1, memory=1)
        done, never, refused = launched
        result = session.wait_for(launched, wait_for_completion=False, timeout_seconds=1)
        assert [w.id for w in result.workers] == [done["id"]]
        assert all(isinstance(w, WorkerSnapshot) for w in result.workers + result.failures)
        [late] = result.failures
        assert late.id == never["id"] and late.status == Status.TIMEDOUT
        assert f"worker {never['id']} was still scheduling after 1 s" in late.message
        # The launch that failed made no worker: it stays CML's dict, listed first.
        assert [dict(f) for f in result.failed_launches] == [refused]
        as_cml = result.to_dict()
        assert [w["id"] for w in as_cml["workers"]] == [done["id"]]
        assert [f.get("id") for f in as_cml["failures"]] == [None, never["id"]]
        assert as_cml["failures"][1]["status"] == "timedout" and type(as_cml["failures"][1]["status"]) is str


def test_with_fail_fast_the_ones_still_going_are_failures_naming_the_other():
    plan = [FakeWorker(exit_code=3), FakeWorker(run_time=30)]
    with Session(FakeBackend(plan), echo=False) as session:
        failing, slow = session.launch_workers(2, cpu=1, memory=1, code="pass")
        result = session.wait_for([failing, slow], timeout_seconds=20, fail_fast=True)
        assert result.workers == ()
        statuses = {w.id: (w.status, w.message) for w in result.failures}
        assert statuses[failing["id"]][0] == Status.FAILED
        assert statuses[slow["id"]] == (
            Status.RUNNING,
            f"worker {slow['id']} was still running when another worker failed",
        )
