"""ipyparallel's and ipykernel's names that cmlcluster reads beyond their API (ipyparallel_internals.py),
probed on the versions installed here, and the error a version without one of them gives."""

from __future__ import annotations

import pytest

from cmlcluster import ipyparallel_internals
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

    monkeypatch.setattr(HeartMonitor, "handle_pong", HeartMonitor.handle_pong)  # undone after the test
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
