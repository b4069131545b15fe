"""silence_timeout: the one setting behind the three clocks that decide a silent worker is lost (its
agent's watchdog, the controller's heartbeat misses, ssh's keepalives), each backend's default, its
checks, and the messages that name it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import cmlcluster
from cmlcluster import ConfigError, Session, runtime, supervisor, wire
from cmlcluster.agent import engine as agent_engine
from cmlcluster.backends.base import Capabilities, SessionContext
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.backends.local import LocalBackend
from cmlcluster.backends.ssh.backend import SSHBackend
from cmlcluster.control import plane as control
from cmlcluster.ssh.config import keepalive_options, keepalive_seconds

BAD = [0, 0.5, -1, "60", True, float("nan"), float("inf"), [60]]


def test_each_backend_declares_its_default_and_a_session_takes_it_unless_given_one():
    assert LocalBackend().capabilities().silence_timeout == 10  # nothing but this host in between
    assert SSHBackend(["10.0.0.5"]).capabilities().silence_timeout == 60  # a real network
    # A third party's backend, which says nothing: workers elsewhere, across a network.
    assert Capabilities(own_address=True, session_host=False, python="python3", shared_paths=()).silence_timeout == 60
    with Session(FakeBackend(), echo=False) as s:
        assert s.silence_timeout == 60
    short = Capabilities(own_address=False, session_host=True, python="python3", shared_paths=(), silence_timeout=3)
    with Session(FakeBackend(capabilities=short), echo=False) as s:
        assert s.silence_timeout == 3
    with Session(FakeBackend(capabilities=short), echo=False, silence_timeout=25) as s:
        assert s.silence_timeout == 25


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_silence_timeout_is_refused_before_anything_starts_naming_it_and_the_fix(bad):
    backend = FakeBackend()
    with pytest.raises(ConfigError) as e:
        Session(backend, echo=False, silence_timeout=bad)
    assert f"silence_timeout={bad!r}" in str(e.value) and "e.g. silence_timeout=60" in str(e.value)
    assert backend.handles == {} and not backend.control.started
    with pytest.raises(ConfigError, match=r"silence_timeout=.*e\.g\. silence_timeout=60"):
        cmlcluster.use_backend("fake", silence_timeout=bad)
    assert cmlcluster.api._backend is None  # the choice before stands


def test_use_backend_passes_it_to_the_default_session_not_to_the_backend():
    try:
        cmlcluster.use_backend("fake", silence_timeout=30)  # the fake backend takes no such option
        session = cmlcluster.get_session()
        assert session.silence_timeout == 30 and session.backend.name == "fake"
        cmlcluster.use_backend("fake")
        assert cmlcluster.get_session().silence_timeout == 60
    finally:
        cmlcluster.stop_session()
        cmlcluster.use_backend(None)


class RealControlPlane(FakeBackend):
    """A fake backend that asks for the real control plane: the session makes an IPyParallelControl."""

    def control_plane(self):
        return None


def test_the_session_gives_its_silence_to_the_backend_the_controller_and_the_agents(monkeypatch):
    made = []

    def control_plane(**options):
        made.append(control.IPyParallelControl(**options))
        return backend.control  # the fake's, which runs no controller

    backend = RealControlPlane()
    monkeypatch.setattr(runtime, "IPyParallelControl", control_plane)
    with Session(backend, echo=False, silence_timeout=25) as s:
        s.launch_workers(1, cpu=1, memory=1)
        assert backend.context.silence_timeout == 25  # ssh's keepalives read it there
        [plane] = made
        assert plane.silence_timeout == 25
        assert float(plane.agent_env()[wire.SILENCE_ENV]) == 25  # every worker's agent starts with it
        assert s.silence_timeout == 25  # the messages name it


def test_the_controller_gives_up_on_an_engine_after_its_agent_has():
    for silence in (1, 8, 10, 60, 3600):
        args = control.heart_monitor_args(silence)
        period = int(next(a for a in args if a.startswith("--HeartMonitor.period=")).split("=")[1])
        misses = int(next(a for a in args if a.startswith("--HeartMonitor.max_heartmonitor_misses=")).split("=")[1])
        assert period == wire.HEARTBEAT_MS
        assert misses * period / 1000 == pytest.approx(silence + control.HUB_SILENCE_MARGIN, abs=period / 1000)
    assert control.HUB_SILENCE_MARGIN >= 5  # time for the backend to report the agent's exit first


def test_an_agent_reads_its_silence_from_its_environment():
    assert agent_engine.silence_seconds("8.0") == 8
    for bad in ("", "0", "-3", "nan", "inf", "sixty"):
        assert agent_engine.silence_seconds(bad) == wire.DEFAULT_SILENCE_TIMEOUT


@pytest.mark.parametrize("silence", [8, 10, 20, 30, 60, 3600])
def test_ssh_gives_up_on_a_silent_connection_in_half_the_timeout_leaving_the_rest_to_a_new_one(silence):
    options = keepalive_options(silence)
    interval = int(options[1].removeprefix("ServerAliveInterval="))
    misses = int(options[3].removeprefix("ServerAliveCountMax="))
    assert options[0] == options[2] == "-o" and 1 <= interval <= 5 and misses >= 1
    gives_up = interval * (misses + 1)  # OpenSSH: at the first keepalive after `misses` unanswered
    assert gives_up == keepalive_seconds(silence)
    assert silence / 2 <= gives_up <= silence / 2 + interval < silence  # then it connects again (ssh/attach.py)


def test_the_ssh_backend_sizes_its_keepalives_and_tells_the_host_its_silence_timeout(tmp_path):
    backend = SSHBackend(["10.0.0.5"])
    backend._checked = True  # no preflight: no host answers here
    asyncio.run(backend.attach(SessionContext("s1", str(tmp_path), silence_timeout=8)))
    argv = backend.ssh_argv("10.0.0.5", "true")
    assert "ServerAliveInterval=2" in argv and "ServerAliveCountMax=1" in argv  # gives up after 4 s
    assert "ConnectTimeout=3" in backend.ssh_argv("10.0.0.5", "true", connect_timeout=3)
    # How the session gives up on a host, and what it says then: tests/unit/backends/ssh/test_relay.py.


def test_a_worker_its_agent_ended_for_silence_fails_naming_the_silence():
    plan = FakeWorker(run_time=30, dies_after=0.3, death_code=wire.SILENCE_EXIT)
    with Session(FakeBackend([plan]), echo=False, silence_timeout=8) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="train()")
        [failure] = s.await_workers([w], timeout_seconds=20)["failures"]
    assert failure["status"] == "failed" and failure["exit_code"] == wire.SILENCE_EXIT
    assert "heard nothing from the session for 8 s (silence_timeout)" in failure["message"]


def test_a_worker_the_controller_lost_fails_naming_the_silence(monkeypatch):
    monkeypatch.setattr(supervisor, "LOST_CONTACT_GRACE", 0.1)
    backend = FakeBackend([FakeWorker(run_time=30, silent_after=1)])
    with Session(backend, echo=False, silence_timeout=8) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, code="train()")
        assert s.await_workers([w], wait_for_completion=False, timeout_seconds=10)["failures"] == []
        [failure] = s.await_workers([w], timeout_seconds=20)["failures"]
    assert failure["status"] == "failed"
    assert f"no heartbeat for {8 + control.HUB_SILENCE_MARGIN:g} s (silence_timeout=8 s)" in failure["message"]


WATCHED = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    import zmq
    from cmlcluster.agent import engine as agent_engine

    pub = zmq.Context().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen(["sleep", "60"])  # the user's program's process, in the agent's group
    print(child.pid, flush=True)

    def ping():  # the controller, for 1 s, then silent
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pub.send(b"ping")
            time.sleep(0.05)

    threading.Thread(target=ping, daemon=True).start()
    log_fd = 2
    if sys.argv[2] == "reader gone":  # its log a pipe whose reader died (the session's, say)
        reader, log_fd = os.pipe()
        os.close(reader)
    agent_engine._watch_controller(f"tcp://127.0.0.1:{port}", 100, {}, log_fd, float(sys.argv[1]))
""")


@pytest.mark.parametrize("log", ["stderr", "reader gone"])
def test_the_watchdog_waits_out_the_silence_then_ends_the_group_and_exits_saying_why(log):
    started, child = time.monotonic(), 0
    agent = subprocess.Popen(
        [sys.executable, "-c", WATCHED, "1.5", log],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, led by it: an agent's
    )
    try:
        child = int(agent.stdout.readline())
        code = agent.wait(timeout=30)
        elapsed = time.monotonic() - started
        assert code == wire.SILENCE_EXIT  # not killed by its own signal: the session can tell why it ended
        if log == "stderr":
            assert "no heartbeat from the controller for 1.5 s (silence_timeout)" in agent.stderr.read()
        assert 2.5 <= elapsed < 15  # 1 s of pings, then 1.5 s of silence
        assert not alive(child)  # the program's process went first
    finally:  # only what this test started, if the watchdog did not end it
        if agent.poll() is None:
            agent.kill()
        if child and alive(child):
            psutil.Process(child).kill()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
