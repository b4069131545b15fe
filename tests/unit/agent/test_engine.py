"""An agent's stop signal handler takes a signal once: a stop's TERM that comes again while the handler runs
(on SSH hosts the relay sends it to the worker's group and to each process below it) returns at once.

Python runs a signal handler on the main thread between two bytecodes, also inside the first handler. Before,
the second ran the sampler's stop again inside the first's Event.set, waited for the lock the first held, and
the worker died of the grace's SIGKILL (-9) in 5 of 8 stops of three SSH workers with sampling on."""

from __future__ import annotations

import threading

import pytest
from ipyparallel.engine.app import IPEngine

from cmlcluster.agent import program as agent_program
from cmlcluster.agent.engine import AgentEngine


@pytest.fixture
def engine(monkeypatch):
    """An AgentEngine that was never started, its class state this test's own."""
    for name, value in (("stop_signal", None), ("interrupting", False), ("sampler", None), ("forwarder", None)):
        monkeypatch.setattr(AgentEngine, name, value)
    return AgentEngine.__new__(AgentEngine)


class HelperThatTakesALock:
    """A sampler's stop as it is: it takes a lock of its own (an Event's); `during` runs while it holds it."""

    def __init__(self, during):
        self.lock = threading.Lock()
        self.during = during
        self.stops = 0

    def stop(self, join_seconds: float = 0.0) -> None:
        assert self.lock.acquire(timeout=2), "the handler ran inside itself and waited for its own lock"
        try:
            self.stops += 1
            self.during()
        finally:
            self.lock.release()


def test_a_second_stop_signal_landing_inside_the_handler_returns_at_once(engine, monkeypatch):
    stopped, programs = [], []
    monkeypatch.setattr(IPEngine, "_signal_stop", lambda self, sig, frame: stopped.append(sig))
    monkeypatch.setattr(agent_program, "stop_program", programs.append)
    second = []

    def second_term_lands_now() -> None:
        if not second:
            second.append(15)
            engine._signal_stop(15, None)

    sampler = HelperThatTakesALock(second_term_lands_now)
    monkeypatch.setattr(AgentEngine, "sampler", sampler)
    engine._signal_stop(15, None)
    # The first took the stop whole, once: the sampler stopped, the engine told, the program ended.
    assert (sampler.stops, stopped, programs, AgentEngine.stop_signal) == (1, [15], [15], 15)


def test_an_interrupt_requests_signal_ends_the_program_and_a_later_stop_still_stops(engine, monkeypatch):
    stopped, programs = [], []
    monkeypatch.setattr(IPEngine, "_signal_stop", lambda self, sig, frame: stopped.append(sig))
    monkeypatch.setattr(agent_program, "stop_program", programs.append)
    monkeypatch.setattr(AgentEngine, "interrupting", True)
    engine._signal_stop(15, None)
    assert (stopped, programs, AgentEngine.stop_signal) == ([], [15], None)
    engine._signal_stop(15, None)
    assert (stopped, programs, AgentEngine.stop_signal) == ([15], [15, 15], 15)
