"""The event bus: order, isolation of slow and failing subscribers, dropping under floods."""

from __future__ import annotations

import threading
import time

from cmlcluster import events
from cmlcluster.events import EventBus, LinesDropped, OutputLine, WorkerStatus
from cmlcluster.workers import Status, WorkerSnapshot


def line(i: int) -> OutputLine:
    return OutputLine("w-0", "stdout", str(i))


def test_each_subscriber_gets_every_event_in_order():
    bus = EventBus("test")
    first, second = [], []
    bus.subscribe(first.append)
    bus.subscribe(second.append)
    for i in range(1000):
        bus.publish(line(i))
    bus.drain(5)
    assert [e.text for e in first] == [str(i) for i in range(1000)]
    assert first == second
    bus.close()


def test_a_stuck_subscriber_never_stalls_publishing_nor_the_others():
    bus = EventBus("test")
    release = threading.Event()
    fast = []
    bus.subscribe(lambda e: release.wait())
    bus.subscribe(fast.append)
    started = time.monotonic()
    for i in range(5000):
        bus.publish(line(i))
    publishing = time.monotonic() - started
    bus.drain(0.5)  # gives up on the stuck one after its timeout
    assert len(fast) == 5000
    assert publishing < 2, f"publishing 5000 events took {publishing:.1f} s behind a stuck subscriber"
    release.set()
    bus.close()


def test_a_failing_subscriber_is_logged_and_keeps_receiving(caplog):
    bus = EventBus("test")
    seen = []

    def fails_on_odd(event):
        seen.append(event.text)
        if int(event.text) % 2:
            raise ValueError("subscriber bug")

    bus.subscribe(fails_on_odd)
    for i in range(4):
        bus.publish(line(i))
    bus.drain(5)
    assert seen == ["0", "1", "2", "3"]
    assert len([r for r in caplog.records if "a subscriber" in r.getMessage() and r.exc_info]) == 2
    bus.close()


def test_a_subscriber_far_behind_misses_the_oldest_output_lines_and_is_told_how_many_where(monkeypatch):
    monkeypatch.setattr(events, "MAX_BACKLOG", 100)
    bus = EventBus("test")
    release = threading.Event()
    got = []

    def slow(event):
        release.wait()
        got.append(event)

    bus.subscribe(slow)
    for i in range(300):
        bus.publish(line(i))
    status = WorkerStatus(WorkerSnapshot(id="w-0", status=Status.RUNNING))
    bus.publish(status)  # never dropped
    release.set()
    bus.drain(5)
    bus.publish(line(300))
    bus.drain(5)
    kept = [e for e in got if isinstance(e, OutputLine)]
    dropped = [e for e in got if isinstance(e, LinesDropped)]
    assert status in got
    assert len(kept) + sum(d.count for d in dropped) == 301
    # The first line may have been taken before the subscriber stalled: 199 or 200 were dropped.
    assert [d.count for d in dropped] in ([199], [200])
    # The newest were kept (the end of a flood is what matters), and the notice stands where lines went.
    texts = [e.text if isinstance(e, OutputLine) else type(e).__name__ for e in got]
    assert texts[-103:] == ["LinesDropped", *map(str, range(200, 300)), "WorkerStatus", "300"], texts[:5]
    bus.close()


def test_unsubscribe_delivers_what_was_queued_then_nothing_more():
    bus = EventBus("test")
    got = []
    unsubscribe = bus.subscribe(got.append)
    bus.publish(line(0))
    unsubscribe()
    bus.publish(line(1))
    time.sleep(0.2)
    assert [e.text for e in got] == ["0"]
    bus.close()


def test_close_ends_every_delivery_thread():
    bus = EventBus("closing")
    for _ in range(3):
        bus.subscribe(lambda e: None)
    bus.publish(line(0))
    bus.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("closing-events")]


def test_report_in_the_sessions_process_goes_to_the_newest_open_session_or_the_one_named(monkeypatch):
    from cmlcluster import Session, report
    from cmlcluster.backends.fake import FakeBackend
    from cmlcluster.events import Progress

    for name in ("CMLCLUSTER_ENGINE_ID", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CDSW_ENGINE_ID", "cml-notebook")  # CML sets it in the notebook too: not a worker
    with Session(FakeBackend([]), echo=False) as older, Session(FakeBackend([]), echo=False) as newer:
        seen = {older.id: [], newer.id: []}
        older.subscribe(seen[older.id].append)
        newer.subscribe(seen[newer.id].append)
        report(1, 10, loss=0.5)
        report(2, 10, session=older, loss=0.4)
        older.drain()
        newer.drain()
        assert seen[newer.id] == [Progress("coordinator", 1.0, 10.0, {"loss": 0.5}, seen[newer.id][0].time)]
        assert [(p.task, p.step) for p in seen[older.id]] == [("coordinator", 2.0)]


def test_report_in_a_worker_is_a_marked_line_and_bad_values_are_refused(monkeypatch, capsys):
    import pytest

    from cmlcluster import ConfigError, report
    from cmlcluster.progress import decode

    monkeypatch.setenv("CMLCLUSTER_ENGINE_ID", "3")
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}, "task": {"type": "worker", "index": 1}}')
    report(3, 9, accuracy=0.75)
    line = capsys.readouterr().out.strip()
    progress = decode(f"[1,0]<stdout>:{line}", "w-3")  # as horovodrun would relay it
    assert (progress.task, progress.step, progress.total, dict(progress.metrics)) == (
        "worker 1",
        3,
        9,
        {"accuracy": 0.75},
    )
    with pytest.raises(ConfigError, match=r"report\(loss='high'\): give a number"):
        report(1, loss="high")


def test_a_horovod_rank_reports_as_the_rank_horovod_gives_it_now(monkeypatch, capsys):
    # An elastic run numbers its ranks again at each reset; HOROVOD_RANK keeps the first number (a
    # survivor that was rank 1 is rank 0 after its partner's loss, and the rank that joins is rank 1).
    import sys
    import types

    from cmlcluster import report
    from cmlcluster.progress import decode

    monkeypatch.setenv("HOROVOD_RANK", "1")
    report(1)
    assert decode(capsys.readouterr().out, "rank 1").task == "rank 1"  # no Horovod in the process: its env
    horovod = types.ModuleType("horovod.tensorflow")
    horovod.rank = lambda: 0
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", horovod)
    report(2)
    assert decode(capsys.readouterr().out, "rank 1").task == "rank 0"

    def not_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")

    horovod.rank = not_initialized
    report(3)
    assert decode(capsys.readouterr().out, "rank 1").task == "rank 1"


def test_after_batch_follows_each_run_of_events_delivered_together_before_they_count_as_handled():
    bus = EventBus("test")
    gate, seen, batches = threading.Event(), [], []

    def slow(event):
        gate.wait(5)  # the first event holds the delivery thread while the rest queue up
        seen.append(event)

    bus.subscribe(slow, after_batch=lambda: batches.append(len(seen)))
    for i in range(100):
        bus.publish(OutputLine("w", "stdout", str(i)))
    gate.set()
    bus.drain(5)
    assert len(seen) == 100 and batches[-1] == 100  # drained: every event handled, then the batch's call
    assert len(batches) <= 3, batches  # one call for many events, not one each
    bus.close()
