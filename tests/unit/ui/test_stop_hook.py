"""The widget's Stop while a cell holds the kernel: ipykernel's routing hook (ui/kernel_internals.py) and
the interrupt of a blocking call (cmlcluster.blocking), on the fake backend."""

from __future__ import annotations

import signal
import threading
import time

import comm as comm_package
import pytest
from ipykernel.comm.comm import BaseComm
from ipykernel.kernelbase import Kernel

from cmlcluster import Session, blocking
from cmlcluster.backends.fake import FakeBackend
from cmlcluster.ui import kernel_internals
from cmlcluster.ui.widget import STOPS_BETWEEN_CELLS, STOPS_THE_CELL, WidgetView

CLICK = {"method": "custom", "content": {"event": "click"}}


class Ipykernel7:
    """What the probe reads of the running kernel: ipykernel's own routing code and its shell-channel thread."""

    shell_channel_thread_main = Kernel.shell_channel_thread_main
    shell_channel_thread = object()


class Shell:
    def __init__(self, kernel: object):
        self.kernel = kernel


@pytest.fixture
def kernel(monkeypatch):
    """As in ipykernel 7: the probe passes, and widgets get ipykernel's comms."""
    monkeypatch.setattr(kernel_internals, "ipython", lambda: Shell(Ipykernel7()))
    monkeypatch.setattr(comm_package, "create_comm", lambda **kw: BaseComm(**kw))


@pytest.fixture(autouse=True)
def nothing_marked():
    yield
    assert blocking._call is None  # no call is left marked, whatever a test did


@pytest.fixture(autouse=True)
def pythons_own_sigint_handler():
    """SIGINT raising KeyboardInterrupt, as in a kernel running a cell: a test that ran before in this
    process may have left another handler (seen in CI), and then Stop rightly refuses to signal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def on_the_shell_channel_thread(call):
    """Run call() on another thread, as ipykernel's shell-channel thread runs the routing; its result."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=call(), thread=threading.current_thread()))
    thread.start()
    thread.join(5)
    return out


def test_each_message_is_seen_on_arrival_and_routed_as_before(kernel):
    hooked, plain = BaseComm(primary=False), BaseComm(primary=False)
    for c in (hooked, plain):
        c._reply_subshell_ids["r1"] = "subshell-1"  # a reply ipykernel routes back to the subshell that asked
    seen = []
    assert kernel_internals.on_arrival(hooked, lambda data: seen.append((data, threading.current_thread())))
    asked = {"method": "custom", "content": {"id": "r1"}}
    for data, default in ((CLICK, None), (asked, "main"), (asked, "main"), (None, "main")):
        out = on_the_shell_channel_thread(lambda d=data, s=default: hooked._reply_subshell_for(d, s))
        assert out["result"] == plain._reply_subshell_for(data, default)
        assert seen[-1] == (data, out["thread"])
    assert len(seen) == 4


def test_a_failing_action_never_loses_the_message(kernel):
    c = BaseComm(primary=False)
    assert kernel_internals.on_arrival(c, lambda data: 1 / 0)
    assert c._reply_subshell_for(CLICK, "main") == "main"


@pytest.mark.parametrize(
    "shell",
    [None, Shell(None), Shell(type("Ipykernel6", (), {"shell_channel_thread": None})())],
    ids=["no IPython", "no kernel", "no shell-channel thread"],
)
def test_nothing_is_hooked_where_the_kernel_cannot(monkeypatch, shell):
    monkeypatch.setattr(kernel_internals, "ipython", lambda: shell)
    c = BaseComm(primary=False)
    assert not kernel_internals.on_arrival(c, lambda data: None)
    assert "_reply_subshell_for" not in vars(c)


def test_a_comm_without_routing_is_not_hooked(kernel):
    c = comm_package.base_comm.BaseComm(primary=False)  # the comm package's own: no _reply_subshell_for
    assert not kernel_internals.on_arrival(c, lambda data: None)


def settled(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert check()


def test_a_click_arriving_during_await_workers_stops_the_workers_and_the_call(kernel):
    with Session(FakeBackend([]), echo=False) as s:
        view = WidgetView(s)
        assert view.stop_button.tooltip == STOPS_THE_CELL
        idle = s.launch_workers(2, cpu=1, memory=1)  # no program: they never finish
        s.await_workers(idle, wait_for_completion=False, timeout_seconds=10)
        settled(lambda: not view.stop_button.disabled)
        clicked = []

        def click():
            clicked.append(time.monotonic())
            view.stop_button.comm._reply_subshell_for(CLICK, None)

        threading.Timer(0.5, click).start()
        with pytest.raises(blocking.StoppedFromWidget) as stopped:
            s.await_workers(idle, wait_for_completion=True, timeout_seconds=0)
        assert time.monotonic() - clicked[0] < 5
        assert str(stopped.value) == "stopped from the widget: workers w0, w1 stopped"  # the views' labels
        assert {w["status"] for w in s.list_workers()} == {"stopped"}  # before the call raised
        settled(lambda: view.stop_button.disabled and view.stop_button.button_style == "")


def test_a_call_without_workers_makes_stop_useful_and_ends_on_a_click(kernel):
    with Session(FakeBackend([]), echo=False) as s:
        view = WidgetView(s)
        settled(lambda: view.stop_button.disabled and view.stop_button.button_style == "")
        with pytest.raises(blocking.StoppedFromWidget, match=r"interrupted \(no workers were running\)"):
            with blocking.blocking(s):  # as run_horovod on the local backend: ranks, no workers
                settled(lambda: not view.stop_button.disabled and view.stop_button.button_style == "danger")
                on_the_shell_channel_thread(lambda: view.stop_button.comm._reply_subshell_for(CLICK, None))
                time.sleep(10)
        settled(lambda: view.stop_button.disabled)


def test_the_kernels_own_interrupt_stays_a_keyboard_interrupt():
    owner = object()
    with pytest.raises(KeyboardInterrupt) as raised:
        with blocking.blocking(owner), blocking.blocking(owner):  # nested: the outer one owns the call
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(10)
    assert type(raised.value) is KeyboardInterrupt


def test_only_the_owners_call_on_the_main_thread_is_interrupted(monkeypatch):
    mine, other = object(), object()
    assert not blocking.interrupt(mine, lambda: "nothing runs")
    with blocking.blocking(other):
        assert not blocking.interrupt(mine, lambda: "not this session's call")

    def off_the_main_thread():
        with blocking.blocking(mine):
            return blocking.busy(mine)

    assert on_the_shell_channel_thread(off_the_main_thread)["result"] is False  # a signal could not reach it
    with blocking.blocking(mine):
        monkeypatch.setattr(signal, "getsignal", lambda n: signal.SIG_IGN)  # an async cell's handler, say
        assert not blocking.interrupt(mine, lambda: "SIGINT would not raise here")


def test_where_nothing_is_hooked_the_button_says_how_a_running_cell_stops():
    with Session(FakeBackend([]), echo=False) as s:
        assert WidgetView(s).stop_button.tooltip == STOPS_BETWEEN_CELLS
