"""The widget's Stop while this process, a cluster's coordinator, trains on it in model.fit
(cmlcluster/tensorflow/stopping.py); the click in a real browser is tests/browser/test_stop_in_browser.py."""

from __future__ import annotations

import _thread
import logging
import signal
import threading

import psutil
import pytest
from harness.processes import wait_until
from harness.tf_training import stacks_in_update_server_def, threads_in_update_server_def, train_as_coordinator

import cmlcluster
from cmlcluster import StoppedFromWidget, blocking

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def pythons_own_sigint_handler():
    """SIGINT raising KeyboardInterrupt, as in a kernel running a cell (Stop refuses to signal otherwise)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.threadName}: {record.getMessage()[:200]}")


def click_stop(session, clicked: list[bool]) -> None:
    """What the widget's Stop does on ipykernel's shell-channel thread (ui/widget.py _on_stop_arrival)."""
    live = [w["id"] for w in session.list_workers() if w["status"] == "running"]
    session.stop_workers_soon(*live)

    def finish() -> str:
        session.stop_workers(*live)
        return f"stopped from the widget: workers {', '.join(live)} stopped"

    clicked.append(blocking.interrupt(session, finish))
    if not clicked[-1]:  # no call marked: fit would wait for the stopped workers for good
        _thread.interrupt_main()


@pytest.mark.parametrize("backend", ["local"], indirect=True)  # Stop does not depend on where workers run
def test_stop_during_fit_ends_it_stops_the_cluster_quietly_and_the_next_cluster_trains(session):
    import tensorflow as tf

    clicked: list[bool] = []

    class StopInTheSecondEpoch(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:  # a moment later, from another thread, as a click arrives
                threading.Timer(0.2, click_stop, (session, clicked)).start()

    logged = Collect()
    logging.getLogger("tensorflow").addHandler(logged)
    try:
        with cmlcluster.start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, session=session) as cluster:
            pids = [session.worker_pid(t.worker_id) for t in cluster.tasks]
            try:
                train_as_coordinator(cluster, epochs=500, callbacks=[StopInTheSecondEpoch()])
                ended = None
            except BaseException as e:  # not pytest.raises: a plain KeyboardInterrupt would end the run
                ended = e
    finally:
        logging.getLogger("tensorflow").removeHandler(logged)
    assert clicked == [True], "fit was not marked as holding the cell: the click only stopped the workers"
    assert isinstance(ended, StoppedFromWidget), repr(ended)
    assert str(ended).startswith("stopped from the widget: workers "), ended
    assert cluster.stopped
    assert sorted(w["status"] for w in session.list_workers()) == ["stopped"] * 3
    assert not any(alive(p) for p in pids)
    # TensorFlow's threads said nothing of the workers' end (each one's gRPC error, "recovering")...
    assert logged.lines == [], logged.lines
    # ...and none waits in update_server_def, where the next cluster's connect would crash it.
    try:
        wait_until(lambda: not threads_in_update_server_def(), timeout=60, what="no thread in update_server_def")
    except AssertionError:
        raise AssertionError(f"threads left in update_server_def: {stacks_in_update_server_def()}") from None

    # The same kernel goes on: the next cluster trains.
    with cmlcluster.start_cluster(n_workers=1, n_ps=1, cpu=1, memory=2, session=session) as again:
        losses = train_as_coordinator(again, epochs=3)
    assert losses[-1] < losses[0], losses


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
