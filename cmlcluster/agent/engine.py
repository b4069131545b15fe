"""The worker's ipyparallel engine, with a watch on the controller that works while user code runs.

The engine's own heartbeat check runs on its event loop, which user code
blocks for as long as it runs. A worker whose session is gone must not train
on for hours, so a watchdog thread listens to the controller's heartbeat pings
(the same ones the engine answers) and ends the worker's whole process group
once they have been silent for the session's silence_timeout. Once registered, a sampler thread sends what
the worker uses (usage.py) on the engine's iopub channel, beside its output, and, where the session gave it
a port for it, a forwarder relays its own address to its app on 127.0.0.1 (apps/forward.py). A stop signal
ends the running program (agent_program) and sends what the engine holds
before the agent dies of it. An interrupt request (the Jupyter protocol's, on the
control channel, which a thread of its own serves while the program runs) ends the
program the same way and leaves the engine serving: the session then takes the worker's
collect= files through it before it stops the worker (collect/through_agents.py). An X-ray
request, on the same channel, is answered with the stacks of the program and its ranks (stacks/).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

from ipykernel.iostream import OutStream
from traitlets import default

from .. import wire
from .._proc import group_members
from . import engine_imports
from . import program as agent_program

engine_imports.engine_without_the_client()  # before the engine's import
from ipyparallel.engine.app import IPEngine  # noqa: E402


def silence_seconds(text: str) -> float:
    """How long the controller's pings (every wire.HEARTBEAT_MS) may be silent before the session is
    taken to be gone: wire.SILENCE_ENV's text, the session's silence_timeout. The default when absent
    or not a positive number: a watchdog that never waits, or never gives up, is no watchdog."""
    try:
        value = float(text)
    except ValueError:
        return wire.DEFAULT_SILENCE_TIMEOUT
    return value if 0 < value < float("inf") else wire.DEFAULT_SILENCE_TIMEOUT


def _watch_controller(ping_url: str, period_ms: int, curve: dict[int, bytes], log_fd: int, allowed: float) -> None:
    import zmq

    context = zmq.Context()
    pings = context.socket(zmq.SUB)
    for option, value in curve.items():
        pings.setsockopt(option, value)
    pings.setsockopt(zmq.SUBSCRIBE, b"")
    pings.connect(ping_url)
    # Silence is counted in empty polls as well as in seconds: a process (or a whole machine)
    # frozen for longer than `allowed` wakes to a clock that jumped, before the pings sent
    # meanwhile have been read; one empty poll then must not end a live session's worker.
    empty_polls_needed = max(1, round(allowed * 1000 / period_ms))
    last, empty_polls = time.monotonic(), 0
    while True:
        if pings.poll(period_ms):
            pings.recv()
            last, empty_polls = time.monotonic(), 0
            continue
        empty_polls += 1
        if empty_polls >= empty_polls_needed and time.monotonic() - last > allowed:
            break
    session_gone(log_fd, f"no heartbeat from the controller for {allowed:g} s (silence_timeout)")


def watch_lifeline(fd: int, log_fd: int) -> None:
    """Started before anything else where the session is on this machine (wire.LIFELINE_FD_ENV): the
    pipe reads end-of-file when the session's process is gone, at once, where the pings' silence takes
    silence_timeout."""
    with contextlib.suppress(OSError):
        while os.read(fd, 1024):
            pass
    session_gone(log_fd, "the session's process ended (its lifeline closed)")


def session_gone(log_fd: int, why: str) -> None:
    """The worker ends with its session: its programs killed, the agent exiting with wire.SILENCE_EXIT."""
    # Its last words may have no reader left (a pipe to the session that died): they must not keep
    # the worker from ending.
    with contextlib.suppress(OSError):
        os.write(log_fd, f"cmlcluster agent: {why}; the session is gone, exiting\n".encode())
    try:
        end_worker_group()
    finally:  # whatever happens there, the agent goes
        os._exit(wire.SILENCE_EXIT)


def end_worker_group() -> None:
    """SIGKILL the rest of the agent's process group (the user's child processes), not the agent: it
    exits with wire.SILENCE_EXIT, which tells the session why, where a signal's -9 would not."""
    me = os.getpid()
    if os.getpgrp() != me:
        return  # not its group's leader (started by hand, say): the group is not the worker's
    deadline = time.monotonic() + 2.0
    with contextlib.suppress(OSError):  # no /proc to list the group in: below
        while time.monotonic() < deadline:  # again until none is left: a process may fork meanwhile
            others = [pid for pid in group_members(me) if pid != me]
            if not others:
                return
            for pid in others:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
    os.killpg(me, signal.SIGKILL)  # a group that cannot be listed, or kept coming back: the agent goes too


class LoggedOutStream(OutStream):
    """The engine's sys.stdout or sys.stderr: sent to the session as ipyparallel's, and also written to the
    worker's own descriptor, its log (which outlives the session: worker_logs.py). Without it the log held
    only what child processes wrote to the descriptors, never what the program printed."""

    def __init__(self, session: Any, pub_thread: Any, name: str, **options: Any) -> None:
        # A copy of the descriptor taken before the stream points it at its own pipe; text it cannot
        # encode is escaped, never raised into the program's print().
        if "echo" not in options:
            fd = os.dup(1 if name == "stdout" else 2)
            options["echo"] = open(fd, "w", encoding="utf-8", errors="backslashreplace")
        super().__init__(session, pub_thread, name, **options)


class AgentEngine(IPEngine):
    """An ipyparallel engine whose controller watch does not depend on its event loop."""

    stop_signal: int | None = None  # the signal that stopped it (the backend's stop), if one did
    # Set by the agent's main before the engine starts:
    controller_connection = ""  # the controller's connection info (JSON), kept out of the environment user code sees
    # The worker's own stderr (its log), kept before the engine points fd 2 at a pipe to the session:
    # the watchdog's last words go there, not into a pipe whose reader dies with the process.
    log_fd = 2
    silence_seconds = wire.DEFAULT_SILENCE_TIMEOUT  # the session's silence_timeout (wire.SILENCE_ENV)
    interrupting = False  # the next SIGTERM is an interrupt request's: it ends the program, not the engine
    sampler: Any = None  # usage.Sampler, started once the engine has registered
    app_forward_port = ""  # wire.APP_FORWARD_PORT_ENV's value, "" for none
    forwarder: Any = None  # app_forward.Forwarder, started with the sampler
    # Held by the sampler's thread across its check that the IOPub thread runs and its send, and by the
    # stop's end while it stops that thread: a send never runs on the sampler's thread (_send_usage).
    usage_sends = threading.Lock()

    def _signal_stop(self, sig: int, frame: Any) -> None:
        if AgentEngine.interrupting:
            AgentEngine.interrupting = False
            agent_program.stop_program(sig)
            return
        if AgentEngine.stop_signal is not None:
            # Stopping already. A stop's TERM comes twice on SSH hosts (to the worker's group, and to each
            # process below its relay), and the second can land while this handler runs on the same thread,
            # inside the sampler's Event.set: a second set() would wait forever for the lock the first holds,
            # and the grace's SIGKILL ended the worker (-9, in 5 of 8 runs of test_workers' stop on SSH hosts
            # with sampling on; py-spy showed the handler within the handler).
            return
        AgentEngine.stop_signal = sig
        for helper in (AgentEngine.sampler, AgentEngine.forwarder):
            if helper is not None:
                helper.stop()
        super()._signal_stop(sig, frame)
        # The engine stops once the program returns: end it now (its finally blocks run), not
        # when the backend's grace runs out and the worker is killed. Once: a second signal
        # must not interrupt the program's cleanup.
        agent_program.stop_program(sig)

    def redirect_output(self, iopub_socket: Any) -> None:
        # ipyparallel 9's prints each handler of its log to the new sys.stdout (a debugging print left in):
        # every worker's first reply waited for that line's flush, and the session got it as output.
        from ipyparallel.engine import app

        app.print = _print_nothing  # the module's globals come before builtins
        try:
            super().redirect_output(iopub_socket)
        finally:
            del app.print

    def restore_output(self) -> None:
        # ipyparallel's stop points sys.stdout/err back at the process's own as the engine shuts down.
        # A program the stop interrupts runs its cleanup after that (its finally blocks): what it
        # prints then must reach the session like all it printed before, not only the worker's log
        # (where it also lost the race with the agent's end: the fd copier is a thread).
        if not agent_program.in_program():
            super().restore_output()

    def start(self) -> None:
        try:
            super().start()
        finally:
            if AgentEngine.stop_signal is not None:
                self._send_what_is_queued()

    def _send_what_is_queued(self) -> None:
        """Before the agent dies of a stop's signal, what its engine holds leaves for the controller:
        the program's last output and idle status (the IOPub thread's) and its reply, left queued on
        the shell stream when the stop stopped the engine's loop (lost in about 1 stop of 3 before).
        The session reports a stopped worker's end once these are in."""
        import zmq
        from ipykernel.iostream import IOPubThread

        kernel = getattr(self, "kernel", None)
        if kernel is None:  # stopped before it registered: nothing was asked of it
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            kernel.shell_stream.flush(zmq.POLLOUT)
        if AgentEngine.sampler is not None:
            AgentEngine.sampler.stop(join_seconds=1.0)  # stopped at the signal; its last send done
        if isinstance(kernel.iopub_socket, IOPubThread):
            with AgentEngine.usage_sends, contextlib.suppress(Exception):
                kernel.iopub_socket.stop()  # sends what it holds, then ends

    @default("out_stream_factory")
    def _logged_streams(self) -> type:
        return LoggedOutStream

    @default("connection_info_env")
    def _connection_from_session(self) -> str:
        return AgentEngine.controller_connection

    def _interrupt_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """On the control thread: end the running program as a stop's signal does (the signal, so that a
        program blocked in a system call wakes), keeping the engine. ipykernel's own would SIGINT the
        process group, which the engine ignores and a program's children would not survive."""
        if agent_program.in_program() and AgentEngine.stop_signal is None:
            AgentEngine.interrupting = True
            os.kill(os.getpid(), signal.SIGTERM)
        self.kernel.session.send(stream, "interrupt_reply", {"status": "ok"}, parent, ident=ident)

    def _xray_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        """On the control thread: the stacks of the worker's program and of every rank below the agent
        (stacks/gather.py), gathered while the program runs on, within stacks.gather.GATHER_SECONDS."""
        from ..stacks import gather

        try:
            content = {"status": "ok", **gather.gather()}
        except Exception as e:  # said to the session, never lost on this thread
            content = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        self.kernel.session.send(stream, wire.XRAY_REPLY, content, parent, ident=ident)

    def start_heartbeat(self, hb_ping: str, hb_pong: str, hb_period: int, identity: bytes) -> None:
        super().start_heartbeat(hb_ping, hb_pong, hb_period, identity)
        # Registered: the kernel exists (ipyparallel makes it just before it starts the heart).
        self.kernel.control_handlers["interrupt_request"] = self._interrupt_request
        self.kernel.control_handlers[wire.XRAY_REQUEST] = self._xray_request
        import zmq

        curve: dict[int, bytes] = {}
        if self.curve_serverkey:
            curve = {
                zmq.CURVE_SERVERKEY: self.curve_serverkey,
                zmq.CURVE_PUBLICKEY: self.curve_publickey,
                zmq.CURVE_SECRETKEY: self.curve_secretkey,
            }
        threading.Thread(
            target=_watch_controller,
            args=(hb_ping, hb_period, curve, AgentEngine.log_fd, AgentEngine.silence_seconds),
            name="controller-watch",
            daemon=True,
        ).start()
        if AgentEngine.sampler is None:
            from .. import usage

            AgentEngine.sampler = usage.start(self._send_usage, _say)
        if AgentEngine.forwarder is None and AgentEngine.app_forward_port:
            from ..apps import forward as app_forward

            AgentEngine.forwarder = app_forward.start(os.environ, AgentEngine.app_forward_port, _say)

    def _send_usage(self, content: dict[str, Any]) -> None:
        """A resource sample, from the sampler's thread, as a message of its own on the iopub channel: no
        parent request (ipyparallel's client and hub pass such messages by), a topic of its own (the
        session's control plane takes it by that). The IOPub thread sends it: any thread may hand it over."""
        kernel = self.kernel
        iopub = kernel.iopub_socket
        # Once a stop began, the agent stops its IOPub thread (_send_what_is_queued), and a send after that
        # would run on this thread, on the socket the main thread's last sends use: none is made then. The
        # lock keeps that stop from coming between the check and the send.
        thread = getattr(iopub, "thread", None)  # ipykernel's IOPubThread: it sends for any thread while it runs
        with AgentEngine.usage_sends:
            if AgentEngine.stop_signal is not None or thread is None or not thread.is_alive():
                return
            content["engine"] = self.id
            kernel.session.send(iopub, wire.USAGE_MSG_TYPE, content, ident=wire.USAGE_TOPIC)


def _print_nothing(*args: Any, **kwargs: Any) -> None:
    pass


def _say(text: str) -> None:
    """One line of the agent's into the worker's log (never its output: the engine sends that to the session)."""
    with contextlib.suppress(OSError):
        os.write(AgentEngine.log_fd, f"cmlcluster agent: {text}\n".encode())


def import_kernel_without_debugger() -> None:
    """Import ipykernel's debugger module with debugpy hidden, so that it records debugpy as absent.

    An engine has no debugger channel (ipykernel: "debugpy_stream undefined, debugging will not be
    enabled"), yet creating its kernel imports debugpy: 0.15 to 0.25 s of CPU in every worker's
    start. User code can still import debugpy: only this module's record of it is kept.
    """
    hidden = "debugpy" not in sys.modules
    if hidden:
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # makes `import debugpy` fail
    try:
        import ipykernel.debugger  # noqa: F401
    finally:
        if hidden:
            del sys.modules["debugpy"]
