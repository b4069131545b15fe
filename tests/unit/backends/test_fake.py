"""Every status path of the worker API, on the fake backend (no processes)."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError, Session
from cmlcluster.backends.fake import FakeBackend, FakeWorker


def fake_session(*plan: FakeWorker, **options) -> Session:
    return Session(FakeBackend(list(plan), **options), echo=False)


def ids(records):
    return [r["id"] for r in records]


def test_workers_run_their_program_and_succeed():
    with fake_session(FakeWorker(output=("hello",)), FakeWorker()) as s:
        workers = s.launch_workers(2, cpu=1, memory=1, code="print('hello')")
        assert [w["status"] for w in workers] == ["scheduling", "scheduling"]
        assert all(w["ip_address"] == "unknown" for w in workers)
        result = s.await_workers(workers, wait_for_completion=True, timeout_seconds=10)
        assert result["failures"] == []
        assert ids(result["workers"]) == ids(workers)
        assert {w["status"] for w in result["workers"]} == {"succeeded"}
        assert [w["ip_address"] for w in result["workers"]] == ["10.0.0.1", "10.0.0.2"]
        assert all(w["finished_at"] and w["running_at"] and w["duration"] is not None for w in result["workers"])
        assert s.output(workers[0]) == "hello"


def test_a_workers_status_is_cmls_plain_string_in_its_dict_and_equal_to_the_enum_inside():
    from cmlcluster.events import WorkerStatus
    from cmlcluster.workers import Status

    seen = []
    with fake_session(FakeWorker()) as s:
        s.subscribe(lambda e: seen.append(e.worker.status) if isinstance(e, WorkerStatus) else None)
        [w] = s.launch_workers(1, cpu=1, memory=1, code="pass")
        [done] = s.await_workers([w], timeout_seconds=10)["workers"]
    # A CML dict holds the plain string: its repr, json and a caller's `is`/type checks are CML's.
    assert type(done["status"]) is str and "'status': 'succeeded'" in repr(done)
    assert seen[-1] == Status.SUCCEEDED == "succeeded" and f"{Status.SUCCEEDED}" == str(Status.SUCCEEDED) == "succeeded"


def test_wait_for_running_returns_addresses_of_running_workers():
    with fake_session(FakeWorker(start_delay=0.1), FakeWorker(start_delay=0.2)) as s:
        workers = s.launch_workers(2, cpu=0.5, memory=2)  # no program: they serve until stopped
        result = s.await_workers([w["id"] for w in workers], wait_for_completion=False, timeout_seconds=10)
        assert [w["status"] for w in result["workers"]] == ["running", "running"]
        assert [w["ip_address"] for w in result["workers"]] == ["10.0.0.1", "10.0.0.2"]


def test_slow_worker_times_out_while_others_run():
    with fake_session(FakeWorker(), FakeWorker(start_delay=30)) as s:
        fast, slow = s.launch_workers(2, cpu=1, memory=1)
        result = s.await_workers([fast, slow], wait_for_completion=False, timeout_seconds=0.5)
        assert ids(result["workers"]) == [fast["id"]]
        [failure] = result["failures"]
        assert failure["id"] == slow["id"] and failure["status"] == "timedout"
        assert "still scheduling" in failure["message"]
        # timedout is what await saw, not a stored status: the worker is still there.
        assert {w["id"]: w["status"] for w in s.list_workers()}[slow["id"]] == "scheduling"


def test_never_starting_worker_times_out():
    with fake_session(FakeWorker(registers=False)) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="pass")
        result = s.await_workers([w], wait_for_completion=True, timeout_seconds=0.3)
        assert result["workers"] == []
        assert [f["status"] for f in result["failures"]] == ["timedout"]


def test_failed_launch_is_a_dict_without_id_and_stays_a_failure():
    with fake_session(FakeWorker(), FakeWorker(launch_error="no capacity left")) as s:
        ok, bad = s.launch_workers(2, cpu=1, memory=1, code="pass")
        assert "id" in ok and "id" not in bad
        assert "no capacity left" in bad["message"]
        result = s.await_workers([ok, bad], timeout_seconds=10)
        assert ids(result["workers"]) == [ok["id"]]
        assert result["failures"] == [bad]
        assert ids(s.list_workers()) == [ok["id"]]


def test_crash_while_running_fails_with_exit_code_and_output_tail():
    with fake_session(FakeWorker(output=("step 1", "step 2"), run_time=30, dies_after=0.2, death_code=-9)) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="train()")
        result = s.await_workers([w], timeout_seconds=10)
        [failure] = result["failures"]
        assert failure["status"] == "failed"
        assert failure["exit_code"] == -9
        assert "exited with code -9 before its program finished" in failure["message"]
        assert "step 2" in failure["message"]


def test_early_exit_before_running_is_a_failure_with_backend_output():
    with fake_session(FakeWorker(start_delay=5, dies_after=0.05, death_code=3)) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1)
        result = s.await_workers([w], wait_for_completion=False, timeout_seconds=10)
        [failure] = result["failures"]
        assert failure["status"] == "failed" and failure["exit_code"] == 3
        assert "before it was running" in failure["message"]
        assert "died with code 3" in failure["message"]  # from the backend's output


def test_program_exit_code_makes_a_failure():
    with fake_session(FakeWorker(exit_code=2, output=("Traceback", "ValueError: bad"))) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="raise ValueError('bad')")
        [failure] = s.await_workers([w], timeout_seconds=10)["failures"]
        assert failure["status"] == "failed" and failure["exit_code"] == 2
        assert "ValueError: bad" in failure["message"]


def test_unknown_address_never_counts_as_running():
    with fake_session(FakeWorker(address=None)) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1)
        result = s.await_workers([w], wait_for_completion=False, timeout_seconds=0.3)
        assert [f["status"] for f in result["failures"]] == ["timedout"]
        assert s.list_workers()[0]["ip_address"] == "unknown"


def test_worker_that_finishes_while_waiting_for_running_is_a_failure():
    with fake_session(FakeWorker(start_delay=0.05)) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="pass")
        s.await_workers([w], wait_for_completion=True, timeout_seconds=10)
        result = s.await_workers([w], wait_for_completion=False, timeout_seconds=10)
        [failure] = result["failures"]
        assert failure["status"] == "succeeded"
        assert "while waiting for it to run" in failure["message"]


def test_stop_workers_stops_named_then_all_and_is_idempotent():
    with fake_session() as s:
        a, b, c = s.launch_workers(3, cpu=1, memory=1)
        s.await_workers([a, b, c], wait_for_completion=False, timeout_seconds=10)
        stopped = s.stop_workers(a["id"])
        assert [w["status"] for w in stopped] == ["stopped"]
        assert s.stop_workers(a["id"])[0]["status"] == "stopped"  # again: no error, no change
        s.stop_workers()
        assert {w["status"] for w in s.list_workers()} == {"stopped"}
        result = s.await_workers([a, b, c], timeout_seconds=1)
        assert result["workers"] == [] and [f["status"] for f in result["failures"]] == ["stopped"] * 3


def test_await_wakes_on_events_from_other_threads():
    # The registration comes on the session's loop while the caller's thread waits: await must react
    # to the event, not discover it by polling.
    backend = FakeBackend([FakeWorker(start_delay=0.2)])
    with Session(backend, echo=False) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1)
        result = s.await_workers([w], wait_for_completion=False, timeout_seconds=0)
        assert [r["status"] for r in result["workers"]] == ["running"]


def test_events_reach_subscribers():
    events = []
    with fake_session(FakeWorker(output=("a", "b"))) as s:
        s.subscribe(events.append)
        [w] = s.launch_workers(1, cpu=1, memory=1, code="pass")
        s.await_workers([w], timeout_seconds=10)
    assert [e.worker.status for e in events if e.kind == "status"] == ["scheduling", "running", "succeeded"]
    assert [e.text for e in events if e.kind == "output"] == ["a", "b"]


def test_closed_session_refuses_work_and_closes_its_control_plane():
    backend = FakeBackend()
    s = Session(backend, echo=False)
    s.launch_workers(1, cpu=1, memory=1)
    s.close()
    s.close()  # idempotent
    assert backend.control.closed
    assert [w["status"] for w in s.list_workers()] == ["stopped"]  # the final records stay readable
    with pytest.raises(Exception, match="closed"):
        s.launch_workers(1, cpu=1, memory=1)


def test_unknown_worker_id_is_named():
    with fake_session() as s:
        with pytest.raises(ValueError, match="'nope' is not a worker"):
            s.await_workers(["nope"])


def test_worker_that_registers_but_never_answers_fails_with_what_is_known_and_the_next_launch_works():
    with fake_session(FakeWorker(answers=False, output=()), FakeWorker()) as s:
        [silent] = s.launch_workers(1, cpu=1, memory=1, code="pass")
        [failure] = s.await_workers([silent], timeout_seconds=10)["failures"]
        assert failure["status"] == "failed"
        message = failure["message"]
        assert f"worker {silent['id']} (engine 0) registered with the controller but did not answer" in message
        assert "its process is still running" in message
        # ...and it was stopped, not left running.
        assert s.backend.handles[0].exited.done()
        [next_one] = s.launch_workers(1, cpu=1, memory=1, code="pass")
        assert s.await_workers([next_one], timeout_seconds=10)["failures"] == []


def test_one_backend_object_serves_one_open_session_at_a_time():
    backend = FakeBackend()
    with Session(backend, echo=False) as first:
        first.launch_workers(1, cpu=1, memory=1)
        with Session(backend, echo=False) as second:
            with pytest.raises(ConfigError, match=f"already serves session {first.id}, which is open"):
                second.launch_workers(1, cpu=1, memory=1)
        assert first.launch_workers(1, cpu=1, memory=1)[0]["status"] == "scheduling"  # still first's
    with Session(backend, echo=False) as third:  # once closed, a session lets it go
        [w] = third.launch_workers(1, cpu=1, memory=1, code="pass")
        assert third.await_workers([w], timeout_seconds=10)["failures"] == []


def test_a_job_refused_before_it_starts_leaves_the_sessions_other_workers_running():
    from cmlcluster.jobs import Role, launch_job
    from cmlcluster.workers import Resources

    with fake_session(FakeWorker(), gpus=["0"]) as s:
        [idle] = s.launch_workers(1, cpu=1, memory=1)
        assert s.await_workers([idle], wait_for_completion=False, timeout_seconds=10)["failures"] == []
        with pytest.raises(ConfigError, match="nvidia_gpu=2"):  # one GPU here
            launch_job(s, [Role("node", 1, Resources(cpu=1, memory=1, nvidia_gpu=2))], "test job")
        assert [w["status"] for w in s.list_workers()] == ["running"]


@pytest.mark.parametrize(
    "plan",
    [FakeWorker(exit_time=0.3), FakeWorker(exit_code=2, exit_time=0.3), FakeWorker(answers=False, exit_time=0.3)],
    ids=["succeeded", "failed", "never-answered"],
)
def test_a_worker_reported_finished_has_given_its_gpus_back(plan):
    # Its process takes a while to go once its end is decided (it cleans up): await_workers reports
    # it only once the process is gone, so the next launch fits, and never shares a GPU with it.
    with fake_session(plan, plan, gpus=["0", "1"]) as s:
        first = s.launch_workers(2, cpu=1, memory=1, nvidia_gpu=1, code="pass")
        ended = s.await_workers(first, wait_for_completion=True, timeout_seconds=10)
        assert ended["workers"] + ended["failures"] and all(w["status"] != "timedout" for w in ended["failures"])
        assert all(s.backend.handles[i].exited.done() for i in (0, 1))
        second = s.launch_workers(2, cpu=1, memory=1, nvidia_gpu=1)  # refused if they still held their GPUs
        assert sorted(s.backend.handles[i].gpus[0] for i in (2, 3)) == ["0", "1"], second
