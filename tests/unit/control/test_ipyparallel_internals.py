"""ipyparallel's and ipykernel's names that cmlcluster reads beyond their API (control/ipyparallel_internals.py),
probed on the versions installed here, and the error a version without one of them gives."""

from __future__ import annotations

import pytest

from cmlcluster.control import ipyparallel_internals
from cmlcluster.errors import ControllerError


@pytest.fixture(autouse=True)
def unprobed(monkeypatch):
    monkeypatch.setattr(ipyparallel_internals, "_probed", set())


def test_every_name_is_where_cmlcluster_reads_it_on_this_ipyparallel():
    ipyparallel_internals.probe_client()
    ipyparallel_internals.probe_engine()
    assert ipyparallel_internals._probed == {"client", "engine"}


def test_a_renamed_name_is_an_error_naming_the_version_and_the_name(monkeypatch):
    import ipyparallel
    from ipyparallel.engine.app import IPEngine

    monkeypatch.delattr(IPEngine, "restore_output")
    with pytest.raises(ControllerError) as caught:
        ipyparallel_internals.probe_engine()
    message = str(caught.value)
    assert f"ipyparallel {ipyparallel.__version__}" in message and "IPEngine.restore_output" in message
    assert "_signal_stop" not in message  # only what is missing is named
    ipyparallel_internals.probe_client()  # the client's side has all it needs


def test_the_heart_monitor_announces_a_new_heart_as_it_first_answers_not_a_beat_later(monkeypatch):
    from ipyparallel.controller.heartmonitor import HeartMonitor

    monkeypatch.setattr(HeartMonitor, "handle_pong", HeartMonitor.handle_pong)  # both undone after the test
    monkeypatch.setattr(HeartMonitor, "start", HeartMonitor.start)
    ipyparallel_internals.announce_new_hearts_at_once()
    monitor = HeartMonitor(period=250)
    announced: list[set[bytes]] = []
    monkeypatch.setattr(
        monitor, "handle_new_hearts", lambda hearts: (announced.append(set(hearts)), monitor.hearts.update(hearts))
    )
    monitor.lifetime = 1.5
    current = str(monitor.lifetime).encode()
    monitor.handle_pong([b"heart-a", current])
    assert announced == [{b"heart-a"}]  # at its first answer, no beat in between
    monitor.handle_pong([b"heart-a", current])
    monitor.handle_pong([b"heart-b", b"0.25"])  # an answer to a ping long gone: not a heart that beats now
    assert announced == [{b"heart-a"}]


def test_the_hub_starts_without_ipyparallels_quarter_second_sleep(monkeypatch, caplog):
    import time

    from ipyparallel.controller import app

    slept: list[float] = []

    def init_hub(self):  # what ipyparallel's does, as far as time goes
        started = time.monotonic()
        app.time.sleep(0.25)
        slept.append(time.monotonic() - started)

    monkeypatch.setattr(app.IPController, "init_hub", app.IPController.init_hub)  # undone after the test
    ipyparallel_internals.no_sleep_in_hub_start()  # recognises this ipyparallel's init_hub
    assert "own pace" not in caplog.text
    wrapped = app.IPController.init_hub
    monkeypatch.setattr(app.IPController, "init_hub", init_hub)
    monkeypatch.setattr(ipyparallel_internals.inspect, "getsource", lambda _: "time.sleep(0.25)")
    ipyparallel_internals.no_sleep_in_hub_start()
    app.IPController.init_hub(None)
    assert slept[0] < 0.1 and app.time is time  # no sleep in it, and the time module back after it
    assert wrapped.__name__ == "init_hub_without_sleep"  # the real init_hub was recognised and wrapped


def test_a_heart_is_pinged_as_it_connects_and_announced_as_it_answers_not_at_the_beats(monkeypatch):
    """ipyparallel's own heart monitor, in a thread, beating every 10 s: a heart that connects just after a
    beat is pinged half a period after it (no sooner: these pings at most double a period's), seconds
    before the next beat, and announced to the hub as it answers."""
    import threading
    import time

    import zmq
    from ipyparallel.controller import heartmonitor

    monkeypatch.setattr(heartmonitor.HeartMonitor, "handle_pong", heartmonitor.HeartMonitor.handle_pong)
    monkeypatch.setattr(heartmonitor.HeartMonitor, "start", heartmonitor.HeartMonitor.start)
    ipyparallel_internals.announce_new_hearts_at_once()
    monitors: list[heartmonitor.HeartMonitor] = []
    patched_start = heartmonitor.HeartMonitor.start
    monkeypatch.setattr(heartmonitor.HeartMonitor, "start", lambda self: (monitors.append(self), patched_start(self)))
    context = zmq.Context()
    hub = context.socket(zmq.XSUB)  # where the monitor tells the hub of new hearts
    hub_port = hub.bind_to_random_port("tcp://127.0.0.1")
    ping_port, pong_port = (free_port() for _ in range(2))
    threading.Thread(
        target=heartmonitor.start_heartmonitor,
        kwargs=dict(
            ping_url=f"tcp://127.0.0.1:{ping_port}",
            pong_url=f"tcp://127.0.0.1:{pong_port}",
            monitor_url=f"tcp://127.0.0.1:{hub_port}",
            period=10_000,
        ),
        daemon=True,
    ).start()
    time.sleep(1)
    hub.send(b"\x01")  # subscribed: the heart monitor starts, its first beat 10 s away
    beats_from = time.monotonic()
    sockets = [hub]

    def heart(name: bytes) -> tuple[zmq.Socket, zmq.Socket]:
        ping, pong = context.socket(zmq.SUB), context.socket(zmq.DEALER)
        ping.setsockopt(zmq.SUBSCRIBE, b"")
        pong.setsockopt(zmq.IDENTITY, name)
        ping.connect(f"tcp://127.0.0.1:{ping_port}")
        pong.connect(f"tcp://127.0.0.1:{pong_port}")
        sockets.extend((ping, pong))
        return ping, pong

    try:
        time.sleep(0.5)
        ping, pong = heart(b"heart-1")
        assert not ping.poll(3_000), "pinged before half a period had passed since the beat"
        assert ping.poll(3_000), "no ping by 6.5 s, half a period after the beat at 0"
        pong.send(ping.recv())  # the engine's heart echoes the ping
        assert hub.poll(2_000), "the hub heard of no new heart"
        announced = hub.recv_multipart()
        assert any(b"new_heart" in part for part in announced) and any(b"heart-1" in part for part in announced)
        assert time.monotonic() - beats_from < 9  # the next beat is at 10 s
    finally:
        for socket in sockets:
            socket.close(linger=0)
        for monitor in monitors:  # its thread ends, and its sockets with it
            monitor.loop.add_callback(monitor.loop.stop)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_replys_value_is_the_calls_value_and_an_engines_error_is_raised():
    # ipyparallel's client resolves a request's MessageFuture with the value, or with the engine's error as
    # its value (what reply_value, standing in for AsyncResult, raises).
    from ipyparallel.client.futures import MessageFuture
    from ipyparallel.error import RemoteError

    answered, failed = MessageFuture("a"), MessageFuture("b")
    value, error = ipyparallel_internals.reply_value(answered), ipyparallel_internals.reply_value(failed)
    answered.set_result({"pid": 7})
    failed.set_result(RemoteError("ValueError", "bad", "traceback"))
    assert value.result(0) == {"pid": 7}
    with pytest.raises(RemoteError, match="bad"):
        error.result(0)


def test_a_value_given_up_on_leaves_the_clients_own_future_to_resolve_quietly():
    from ipyparallel.client.futures import MessageFuture

    request = MessageFuture("c")
    value = ipyparallel_internals.reply_value(request)
    assert value.cancel()
    request.set_result(3)  # later, on the client's thread: no InvalidStateError there
    assert value.cancelled() and request.result(0) == 3
