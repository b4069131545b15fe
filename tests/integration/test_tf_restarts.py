"""A TensorFlow worker task lost while this process coordinates, replaced (start_cluster's max_restarts):
TensorFlow's coordinator takes the replacement back at the lost task's address and fit() finishes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

import pytest
from harness.processes import agent_pid, wait_until
from harness.tf_training import threads_in_update_server_def, train_as_coordinator

import cmlcluster
from cmlcluster import Session
from cmlcluster.errors import ConfigError
from cmlcluster.events import JobChanged
from cmlcluster.jobs import JobFailed

pytestmark = pytest.mark.integration

REPLACED_WITHIN = 120  # seconds: a local worker's start, TensorFlow's import, the coordinator's 5 s settle


class Killer:
    """A Keras callback that kill -9s worker task `order[k]`'s current worker at epoch ends, one at a
    time: each after the last one's replacement joined, and then stops training `after` epochs on."""

    def __init__(self, cluster, events, order, after=None):
        import tensorflow as tf

        killer = self
        self.killed: list[str] = []

        class Callback(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if killer.killed and len(killer.killed) == len(order):
                    if after is not None and epoch >= killer.last_epoch + after:
                        self.model.stop_training = True
                    return
                if killer.killed:  # the last one's replacement must be in, and TensorFlow's, before the next kill
                    wait_until(lambda: replaced(events) == len(killer.killed), REPLACED_WITHIN, "a replacement")
                    try:
                        wait_until(lambda: not recovering_stacks(), REPLACED_WITHIN, "the replacement taken back")
                    except AssertionError:
                        raise AssertionError(f"still recovering: {recovering_stacks()}") from None
                victim = cluster.workers[order[len(killer.killed)]].worker_id
                os.kill(agent_pid(victim), signal.SIGKILL)
                killer.killed.append(victim)
                killer.last_epoch = epoch

        self.callback = Callback()


def recovering_stacks():
    """The threads of TensorFlow's coordinator taking a lost task back (its preemption handler waiting in
    cmlcluster's guard until every task accepts connections, or in update_server_def), and where.
    A handler parked for good (an earlier test's cluster, stopped while it waited) is not one."""
    names = {t.ident: t.name for t in threading.enumerate()}
    found = {}
    for ident, frame in sys._current_frames().items():
        functions = {f.f_code.co_name for f, _ in traceback.walk_stack(frame)}
        if functions & {"_wait_for_lost_tasks", "update_server_def"} and "_park_for_good" not in functions:
            found[names.get(ident)] = "".join(traceback.format_stack(frame))
    return found


def replaced(events):
    return sum(e.state == "member_replaced" for e in events)


def job_events(session):
    events = []
    session.subscribe(lambda e: events.append(e) if isinstance(e, JobChanged) else None)
    return events


# The same on SSH hosts (a replacement on its host, at its port) and Docker (at its IP, in the session's
# network) in the matrix tier: in the default run they lose a replacement too, below.
@pytest.mark.parametrize("backend", ["local", *[pytest.param(b, marks=pytest.mark.matrix) for b in ("ssh", "docker")]],
                         indirect=True)  # fmt: skip
def test_a_worker_task_killed_mid_training_is_replaced_and_trains_on_and_the_loss_goes_on_falling(backend):
    with Session(backend, echo=False) as session:
        events = job_events(session)
        with cmlcluster.start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, max_restarts=2, session=session) as c:
            address = c.workers[1].address
            # Task 1 dies and is replaced; then task 0 dies, and three more epochs run before task 0's
            # replacement can be in: on task 1's replacement alone, which TensorFlow has taken back.
            killer = Killer(c, events, order=[1, 0], after=3)
            losses = train_as_coordinator(c, epochs=1000, callbacks=[killer.callback])
            assert replaced(events) == 1, "task 0's replacement came in first: the test proves nothing"
            first, second = killer.killed
            assert c.workers[1].worker_id != first and c.workers[1].address == address  # taken back there
            assert c.restarts == 2 and c.failure is None
        # The parameter servers kept the variables: the loss goes on falling through both losses
        # (an undisturbed run of this model ends below 0.05, from about 2).
        assert losses[-1] < 0.1 and losses[-1] < losses[0] / 10, losses
        states = [e.state for e in events]
        assert states[:3] == ["started", "member_lost", "member_replaced"] and states[-1] == "finished", states
        statuses = {w["id"]: w["status"] for w in session.list_workers()}
        assert statuses[first] == statuses[second] == "failed"
        # Task 0's replacement, still starting when the cluster stopped, is stopped too.
        wait_until(lambda: {w["status"] for w in session.list_workers()} == {"failed", "stopped"}, 60, "all stopped")
        wait_until(lambda: not threads_in_update_server_def(), timeout=60, what="no thread in update_server_def")


# A replacement on its lost worker's host, at its port; on Docker at its IP, in the session's network.
@pytest.mark.parametrize("backend", [pytest.param("ssh", marks=pytest.mark.matrix), "docker"], indirect=True)
def test_a_lost_replacement_with_one_restart_fails_fit_with_the_structured_failure(session):
    events = job_events(session)
    # A worker that came before the cluster and is gone by the time a task is lost: Docker would give
    # its address (the lowest free) to a container that did not ask for one.
    [before] = session.launch_workers(1, cpu=0.5, memory=0.5, code="import time; time.sleep(600)")
    session.await_workers([before], wait_for_completion=False, timeout_seconds=60)
    with pytest.raises(JobFailed, match="after 1 restart: worker task 1") as caught:
        with cmlcluster.start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, max_restarts=1, session=session) as c:
            session.stop_workers(before)
            address = c.workers[1].address
            killer = Killer(c, events, order=[1, 1])
            train_as_coordinator(c, epochs=1000, callbacks=[killer.callback])
    first, second = killer.killed
    assert first != second and c.workers[1].address == address  # replaced where it ran
    assert caught.value.failure.exit_code == -9 and caught.value.restarts == 1
    assert caught.value.failure.member.worker_id == second
    statuses = sorted(w["status"] for w in session.list_workers() if w["id"] != before["id"])
    assert statuses == ["failed", "failed", "stopped", "stopped"], statuses


# A pod's address is the cluster's to choose (the stand-in's, like a real one's): no replacement could
# come back where TensorFlow waits for it, so the run is refused before anything starts, saying so.
@pytest.mark.parametrize("backend", ["kubernetes"], indirect=True)
def test_where_a_replacement_cannot_have_the_lost_tasks_address_max_restarts_is_refused_at_once(session):
    with pytest.raises(ConfigError, match=r"max_restarts=1: TensorFlow takes a lost worker back only at its address"):
        cmlcluster.start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, max_restarts=1, session=session)
    assert session.list_workers() == []
