"""The job layer's restart policy (jobs.Restarts), on the fake backend: what a lost member means."""

from __future__ import annotations

import re
import threading
import time

import pytest

from cmlcluster import Session
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.events import JobChanged, Member
from cmlcluster.jobs import JobFailed, Restarts, Role, launch_job
from cmlcluster.workers import STOPPED, Resources

ONE = Resources(cpu=1, memory=1)


def session_of(plan: dict[int, FakeWorker]) -> Session:
    """Worker i (launch order, replacements included) follows plan[i], or serves until stopped."""
    return Session(FakeBackend(lambda i: plan.get(i, FakeWorker())), echo=False)


class Replacements:
    """A framework's replace(lost, new) hook that records its calls and can refuse."""

    def __init__(self, refuse: str = ""):
        self.calls: list[tuple[Member, Member]] = []
        self.refuse = refuse
        self.done = threading.Event()

    def __call__(self, lost: Member, new: Member) -> None:
        self.calls.append((lost, new))
        self.done.set()
        if self.refuse:
            raise RuntimeError(self.refuse)


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def job_events(session: Session) -> list[JobChanged]:
    seen: list[JobChanged] = []
    session.subscribe(lambda e: seen.append(e) if isinstance(e, JobChanged) else None)
    return seen


def roles(replaceable: bool = True) -> list[Role]:
    return [Role("ps", 1, ONE), Role("worker", 2, ONE, replaceable=replaceable)]


def test_a_lost_member_is_replaced_with_the_same_role_and_index_and_the_job_goes_on():
    with session_of({2: FakeWorker(dies_after=0.3)}) as s:  # worker 1 (launch order: ps, w0, w1)
        events = job_events(s)
        hook = Replacements()
        job = launch_job(s, roles(), "test job", restarts=Restarts(max_restarts=1, replace=hook))
        lost = job.members[2]
        assert hook.done.wait(10)
        [(old, new)] = hook.calls
        assert old == lost and (new.role, new.index) == ("worker", 1) and new.worker_id != lost.worker_id
        assert new.address  # it runs
        assert not job.failed.is_set() and job.restarts == 1
        assert new in job.members and lost not in job.members and len(job.members) == 3
        wait_for(lambda: len(events) == 3)  # published after the hook returned
        states = [e.state for e in events]
        assert states[:2] == ["started", "member_lost"] and "member_replaced" in states
        [lost_event] = [e for e in events if e.state == "member_lost"]
        assert lost_event.failures[0].exit_code == -9 and lost_event.restarts == 1
        assert "replaced worker" in " ".join(n for e in events for n in e.notes())
        job.stop()
        statuses = {w["id"]: w["status"] for w in s.list_workers()}
        assert all(statuses[m.worker_id] == STOPPED for m in job.members)


def test_restarts_used_up_fail_the_job_as_without_them_and_say_after_how_many():
    # worker 1 dies, and so does its replacement (launched 4th)
    with session_of({2: FakeWorker(dies_after=0.3), 3: FakeWorker(dies_after=0.3)}) as s:
        hook = Replacements()
        job = launch_job(s, roles(), "test job", restarts=Restarts(max_restarts=1, replace=hook))
        assert job.failed.wait(10)
        assert len(hook.calls) == 1 and job.restarts == 1
        with pytest.raises(JobFailed, match="test job failed after 1 restart: worker task 1") as failed:
            job.raise_if_failed()
        assert failed.value.restarts == 1 and failed.value.failure.exit_code == -9
        others = [m.worker_id for m in job.members if m != failed.value.failure.member]
        s.await_workers(others, wait_for_completion=True, timeout_seconds=10)
        assert {w["id"]: w["status"] for w in s.list_workers() if w["id"] in others} == dict.fromkeys(others, STOPPED)


@pytest.mark.parametrize("replaceable", [False, True], ids=["a role not replaceable", "no restarts asked"])
def test_a_member_that_cannot_be_replaced_fails_the_job_without_a_replacement(replaceable):
    restarts = None if replaceable else Restarts(max_restarts=3, replace=Replacements())
    with session_of({2: FakeWorker(dies_after=0.3)}) as s:
        job = launch_job(s, roles(replaceable), "test job", restarts=restarts)
        assert job.failed.wait(10)
        with pytest.raises(JobFailed, match=r"test job failed: worker task 1 \(worker \S+\) failed"):
            job.raise_if_failed()
        assert len(s.list_workers()) == 3  # nothing launched to replace it


def test_a_replacement_that_does_not_start_fails_the_job_naming_both_ends():
    with session_of({2: FakeWorker(dies_after=0.3), 3: FakeWorker(launch_error="no room left")}) as s:
        hook = Replacements()
        job = launch_job(s, roles(), "test job", restarts=Restarts(max_restarts=2, replace=hook))
        assert job.failed.wait(10)
        assert hook.calls == []
        with pytest.raises(JobFailed, match=r"its replacement failed: could not launch worker .*: no room left"):
            job.raise_if_failed()


def test_a_replacement_the_framework_refuses_fails_the_job_and_is_stopped_with_the_others():
    with session_of({2: FakeWorker(dies_after=0.3)}) as s:
        hook = Replacements(refuse="its server did not start")
        job = launch_job(s, roles(), "test job", restarts=Restarts(max_restarts=2, replace=hook))
        assert job.failed.wait(10)
        [(_, new)] = hook.calls
        with pytest.raises(JobFailed, match="its replacement failed: its server did not start"):
            job.raise_if_failed()
        s.await_workers([new.worker_id], wait_for_completion=True, timeout_seconds=10)
        assert {w["id"]: w["status"] for w in s.list_workers()}[new.worker_id] == STOPPED


def test_a_replacement_at_another_address_is_refused_where_the_framework_needs_the_same_one():
    # The fake gives each worker an address of its own, as containers without a fixed IP get.
    with session_of({2: FakeWorker(dies_after=0.3)}) as s:
        hook = Replacements()
        restarts = Restarts(max_restarts=1, replace=hook, same_address=True)
        job = launch_job(s, roles(), "test job", restarts=restarts)
        assert job.failed.wait(10)
        assert hook.calls == []
        with pytest.raises(JobFailed, match=r"runs at 10\.0\.0\.4, not at the lost one's 10\.0\.0\.3"):
            job.raise_if_failed()


def test_a_job_that_finishes_while_a_replacement_starts_stops_it_and_does_not_fail():
    with session_of({2: FakeWorker(dies_after=0.3), 3: FakeWorker(start_delay=1.0)}) as s:
        events = job_events(s)
        hook = Replacements()
        job = launch_job(s, roles(), "test job", restarts=Restarts(max_restarts=1, replace=hook))
        wait_for(lambda: any(e.state == "member_lost" for e in events))
        job.stop()  # the user ends the run while the replacement registers
        s.await_workers([w["id"] for w in s.list_workers()], wait_for_completion=True, timeout_seconds=10)
        assert not job.failed.is_set() and hook.calls == []
        assert {w["status"] for w in s.list_workers()} <= {STOPPED, "failed"}
        assert len(s.list_workers()) == 4 and s.list_workers()[3]["status"] == STOPPED


def test_the_views_say_what_was_lost_and_name_the_replacement_as_its_task(capsys):
    from cmlcluster.ui.terminal import TerminalView
    from cmlcluster.ui.widget import WidgetView

    with session_of({2: FakeWorker(dies_after=0.3)}) as s:
        widget = WidgetView(s)
        TerminalView(s)
        hook = Replacements()
        job = launch_job(s, roles(), "test job", restarts=Restarts(max_restarts=1, replace=hook))
        assert hook.done.wait(10)
        [(lost, new)] = hook.calls
        s.drain()
        wait_for(lambda: f'data-worker="{new.worker_id}"' in widget.table.value and "replaced" in widget.table.value)
        row = re.search(rf'<tr data-worker="{new.worker_id}".*?</tr>', widget.table.value).group(0)
        assert "<td>worker 1</td>" in row  # the replacement's row is the task it replaced
        assert f"test job: lost worker task 1 (worker {lost.worker_id}) failed with exit code -9" in widget.table.value
        assert "(restart 1)" in widget.table.value
        replaced = f"test job: worker {new.worker_id} replaced worker {lost.worker_id} as worker 1"
        assert replaced in widget.table.value
        job.stop()
    printed = capsys.readouterr().err  # cmlcluster's own lines
    assert f"[cmlcluster] {replaced}" in printed and "replacing it (restart 1)" in printed
