"""Every name of ipyparallel (and ipykernel) beyond their documented API that cmlcluster relies on.

The session's client sends each request through the client's own mux stream, hears of
registrations as they happen and asks the hub for those it missed (control/plane.py says why), and takes the
agents' resource samples off its iopub stream (usage.py); the
worker's engine overrides how it stops, restores its output and starts its heartbeat
(agent/engine.py says why). probe_client() and probe_engine() check each of these names on the
ipyparallel installed, once per process, before it is used: an ipyparallel that renamed one is an
error naming its version and the name, not a worker that silently never registers or a stop that
loses its last lines.
(The widget's hook on ipykernel's comm routing is ui/kernel_internals.py: only the UI uses it.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import probes
from ..errors import ControllerError

log = logging.getLogger(__name__)

_probed: set[str] = set()  # "client", "engine": the sides already probed in this process


def registration_callbacks(client: Any) -> list[Callable[[dict[str, Any]], None]]:
    """The client's list of callbacks for engine (un)registrations (ipyparallel's wait_for_engines uses it)."""
    callbacks: list[Callable[[dict[str, Any]], None]] = client._registration_callbacks
    return callbacks


def mux_stream(client: Any) -> Any:
    """The ZMQStream the client's own views send apply requests through."""
    return client._mux_stream


def engine_ident(client: Any, engine_id: int) -> bytes:
    """The routing identity of one engine, for send_apply_request(ident=...)."""
    idents, _ = client._build_targets(engine_id)
    ident: bytes = idents[0]
    return ident


async def hub_engines(client: Any, timeout: float) -> dict[int, str]:
    """The engines registered at the hub now, {id: uuid}: its answer to the connection request the
    client sends once, as it connects. The request leaves on the client's IO thread; nothing blocks."""
    request = client._send(client._query_stream, "connection_request")
    reply = await asyncio.wait_for(asyncio.wrap_future(request), timeout)
    return {int(engine_id): uuid for engine_id, uuid in reply["content"]["engines"].items()}


def send_control_request(client: Any, engine_id: int, msg_type: str) -> Any:
    """Send a request to one engine's control channel (the Jupyter protocol's interrupt_request, or an
    X-ray's: the agent's engine serves both, agent/engine.py); a future of [the reply message]. Sent on
    the client's IO thread."""
    return client._send_control_request(targets=engine_id, msg_type=msg_type, content={}, block=False)


def register_engines(client: Any, engines: dict[int, str]) -> None:
    """Have the client take in the engines it lacks as their registration notifications would (their
    routing identities, its registration callbacks), on its IO thread, where notifications are
    handled: one whose notification came meanwhile is not taken in twice."""

    def register() -> None:
        missed = {engine_id: uuid for engine_id, uuid in engines.items() if engine_id not in client._engines}
        if missed:
            log.info("the hub registered engines %s that the session's client missed; taking them in", sorted(missed))
        for engine_id, uuid in missed.items():
            client._register_engine({"content": {"id": engine_id, "uuid": uuid}})

    client._io_loop.add_callback(register)


def reply_value(message_future: Any) -> concurrent.futures.Future[Any]:
    """The value of one engine's apply request, or its error raised: what ipyparallel's AsyncResult gives for
    one target, without the three events and three futures it builds per request. At 1,024 workers those
    made a call_each allocate enough that Python ran about three full collections per call (its cost per
    worker 1.9x that at 16 workers; the same with the collector off: bench/printing_model.py).
    The client resolves a request's MessageFuture with the value, or with the engine's error (RemoteError,
    EngineError, TaskAborted) *as* its value. Cancelling what this returns leaves the request's own
    future to the client, which resolves it later (a cancelled one would raise on the client's thread)."""
    value: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def settle(reply: concurrent.futures.Future[Any]) -> None:
        if reply.cancelled():
            value.cancel()
            return
        error = reply.exception()
        result = None if error is not None else reply.result()
        if isinstance(result, Exception):
            error = result
        try:
            if error is not None:
                value.set_exception(error)
            else:
                value.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass  # given up on (cancelled) meanwhile

    message_future.add_done_callback(settle)
    return value


def forget_stream_text(client: Any, message: dict[str, Any]) -> None:
    """Drop the text the client kept of a stream message's request (an iopub callback, called just
    after the client stored it). ipyparallel's client keeps each request's whole output in
    client.metadata and copies it on every stream message, on the thread that carries every reply:
    a program printing for hours would fill the notebook's memory and delay its replies. The
    session has the output already (its own callback)."""
    metadata = client.metadata.get(message["parent_header"].get("msg_id"))
    if metadata is not None:
        metadata[message["content"]["name"]] = ""


def route_iopub_topic(client: Any, topic: bytes, callback: Callable[[dict[str, Any]], None]) -> None:
    """Hand the client's iopub messages whose topic starts with `topic` to callback(message) (deserialized,
    their signature checked), on the client's IO thread; every other message goes on to the client's own
    dispatch. The agents' resource samples travel so (usage.py): messages of no request, which the client's
    dispatch would only parse and drop. Installed on the IO thread, where the stream's callback is read."""
    stream, dispatch, session = client._iopub_stream, client._dispatch_iopub, client.session

    def route(frames: list[Any]) -> None:
        first = frames[0] if frames else b""
        if not bytes(getattr(first, "bytes", first)).startswith(topic):
            dispatch(frames)
            return
        try:
            _, message = session.feed_identities(frames, copy=False)
            message = session.deserialize(message, content=True, copy=False)
        except Exception:
            log.warning("cmlcluster: an iopub message of topic %r could not be read", topic, exc_info=True)
            return
        callback(message)

    client._io_loop.add_callback(lambda: stream.on_recv(route, copy=False))


def captured_fd_unread(stream: Any) -> int:
    """How many bytes wait in the pipe an ipykernel OutStream captures fd 1 or 2 through (what child
    processes wrote, not yet read by the stream's watcher thread); 0 when it captures none."""
    import fcntl
    import struct
    import termios

    fid = getattr(stream, "_fid", None)
    if fid is None:
        return 0
    try:
        unread: int = struct.unpack("i", fcntl.ioctl(fid, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0
    return unread


def announce_new_hearts_at_once() -> None:
    """In the controller: its heart monitor pings an engine's heart as it connects and announces it to the
    hub at its first answer. ipyparallel's (HeartMonitor.beat) pings at the next beat, up to a period (250
    ms) later, and announces a heart at the beat after its answer, another period: each worker's
    registration waited on both. Pings sent between beats carry the current beat's stamp, so an answer
    counts as the answer to that beat; engines connecting together share one (_ping_as_hearts_connect).
    Later beats treat a heart as they would have. Left as it is, with a warning, on an ipyparallel whose
    heart monitor lacks what this reads."""
    missing = probes.missing(_heart_monitor_checks())
    if missing:
        log.warning("cmlcluster: hearts announced at ipyparallel's own pace (it lacks %s)", "; ".join(missing))
        return
    from ipyparallel.controller.heartmonitor import HeartMonitor

    answered, started = HeartMonitor.handle_pong, HeartMonitor.start

    def handle_pong(self: Any, msg: list[bytes]) -> None:
        answered(self, msg)
        heart = msg[0]
        if heart in self.responses and heart not in self.hearts:
            self.handle_new_hearts({heart})

    def start(self: Any) -> None:
        started(self)  # beats from now on
        _ping_as_hearts_connect(self)

    HeartMonitor.handle_pong, HeartMonitor.start = handle_pong, start


PING_SOON = 0.02  # seconds from a heart's connection to its ping: its subscription arrives meanwhile


def _ping_as_hearts_connect(monitor: Any) -> None:
    """A ping soon after each heart connects: never sooner than half a period after the last ping (a beat
    or one of these), and none when the next beat comes first. Every heart answers every ping, so these at
    most double the pings of a period, and only while hearts connect (1,024 at once: control_plane_model)."""
    import zmq
    from zmq.eventloop.zmqstream import ZMQStream

    connections = monitor.ping_stream.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    half = monitor.period / 2000  # seconds
    pending, last = False, 0.0

    def ping() -> None:
        nonlocal pending, last
        pending, last = False, time.monotonic()
        monitor.ping_stream.send(str(monitor.lifetime).encode("ascii"))

    def connected(_event: list[bytes]) -> None:
        nonlocal pending
        at = max(time.monotonic() + PING_SOON, monitor.tic + half, last + half)  # tic: the last beat
        if not pending and at < monitor.tic + 2 * half:
            pending = True
            monitor.loop.call_later(at - time.monotonic(), ping)

    ZMQStream(connections, monitor.loop).on_recv(connected)


def no_sleep_in_hub_start() -> None:
    """In the controller: the hub's start without the quarter second ipyparallel sleeps in it (init_hub's
    `time.sleep(0.25)`, after binding the monitor socket). Nothing waits on it: a bind is done when it
    returns, the hub's loop (which serves registrations) starts after, and the heart monitor waits for
    its own subscription. Every worker's launch waited on it. Left as it is on another ipyparallel."""
    from ipyparallel.controller import app

    source = inspect.getsource(app.IPController.init_hub)
    if source.count("time.sleep(") != 1 or "time.sleep(0.25)" not in source or app.time is not time:
        log.warning("cmlcluster: the hub starts at ipyparallel's own pace (its init_hub changed)")
        return
    init_hub = app.IPController.init_hub

    def init_hub_without_sleep(self: Any) -> None:
        app.time = _NoSleep()
        try:
            init_hub(self)
        finally:
            app.time = time

    app.IPController.init_hub = init_hub_without_sleep


class _NoSleep:
    """The time module, but for sleep."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def _heart_monitor_checks() -> list[probes.Check]:
    from ipyparallel.controller.heartmonitor import HeartMonitor

    names = HeartMonitor.class_trait_names()
    return [
        (
            "HeartMonitor.handle_pong(msg)",
            lambda: list(inspect.signature(HeartMonitor.handle_pong).parameters)[1:] == ["msg"],
        ),
        ("HeartMonitor.handle_new_hearts(hearts)", lambda: callable(HeartMonitor.handle_new_hearts)),
        ("HeartMonitor.start()", lambda: list(inspect.signature(HeartMonitor.start).parameters) == ["self"]),
        (
            "HeartMonitor.hearts, .responses, .lifetime, .tic, .period, .ping_stream and .loop",
            lambda: {"hearts", "responses", "lifetime", "tic", "period", "ping_stream", "loop"} <= set(names),
        ),
        (
            "HeartMonitor.beat pings with str(self.lifetime)",
            lambda: "self.ping_stream.send(str(self.lifetime).encode('ascii'))" in inspect.getsource(HeartMonitor.beat),
        ),
        (
            "HeartMonitor.handle_pong adds an answer to .responses",
            lambda: "self.responses.add(msg[0])" in inspect.getsource(HeartMonitor.handle_pong),
        ),
    ]


def probe_client() -> None:
    _probe("client", _client_checks)


def probe_engine() -> None:
    _probe("engine", _engine_checks)


def _probe(side: str, checks: Callable[[], list[probes.Check]]) -> None:
    if side in _probed:
        return
    missing = probes.missing(checks())
    if missing:
        import ipyparallel

        raise ControllerError(
            f"ipyparallel {ipyparallel.__version__} lacks what cmlcluster's {side} reads of it: "
            f"{'; '.join(missing)}. Install the ipyparallel cmlcluster requires: "
            "pip install 'ipyparallel>=9,<10'."
        )
    _probed.add(side)


def _client_checks() -> list[probes.Check]:
    def client() -> Any:
        from ipyparallel import Client

        return Client

    return [
        ("Client._registration_callbacks", lambda: "_registration_callbacks" in client().class_trait_names()),
        ("Client._mux_stream", lambda: "self._mux_stream = " in inspect.getsource(client()._setup_streams)),
        ("Client._build_targets", lambda: callable(client()._build_targets)),
        ("Client._send(socket, msg_type) -> a future", lambda: callable(client()._send)),
        ("Client._register_engine", lambda: callable(client()._register_engine)),
        ("Client._query_stream", lambda: "self._query_stream = " in inspect.getsource(client()._setup_streams)),
        ("Client._io_loop", lambda: "_io_loop" in client().class_trait_names()),
        ("Client._send_control_request(targets, msg_type, content, block)", _send_control_request),
        ("Client._dispatch_iopub stores a stream's text, then runs the iopub callbacks", _stream_text_then_callbacks),
        (
            "Client._iopub_stream, read by Client._dispatch_iopub (copy=False)",
            lambda: (
                "self._iopub_stream.on_recv(self._dispatch_iopub, copy=False)"
                in inspect.getsource(client()._setup_streams)
            ),
        ),
        (
            "Client.send_apply_request(..., ident=, message_future_hook=)",
            lambda: {"ident", "message_future_hook"} <= set(inspect.signature(client().send_apply_request).parameters),
        ),
    ]


def _send_control_request() -> bool:
    from ipyparallel import Client

    parameters = list(inspect.signature(Client._send_control_request).parameters)[1:]
    return parameters == ["targets", "msg_type", "content", "block"]


def _stream_text_then_callbacks() -> bool:
    from ipyparallel import Client

    source = inspect.getsource(Client._dispatch_iopub)
    stored, called = source.find("md[name] = new_text"), source.find("iopub_callbacks")
    return 0 <= stored < called


def _engine_checks() -> list[probes.Check]:
    def engine() -> Any:
        from ipyparallel.engine.app import IPEngine

        return IPEngine

    return [
        ("IPEngine._signal_stop", lambda: callable(engine()._signal_stop)),
        ("IPEngine.restore_output", lambda: callable(engine().restore_output)),
        (
            "IPEngine.redirect_output(iopub_socket)",
            lambda: "iopub_socket" in inspect.signature(engine().redirect_output).parameters,
        ),
        (
            "IPEngine.start_heartbeat(hb_ping, hb_pong, hb_period, identity)",
            lambda: (
                list(inspect.signature(engine().start_heartbeat).parameters)[1:]
                == ["hb_ping", "hb_pong", "hb_period", "identity"]
            ),
        ),
        ("IPEngine.connection_info_env", lambda: engine().class_traits().get("connection_info_env") is not None),
        ("ipykernel.iostream.IOPubThread.stop", _iopub_thread_stop),
        ("ipykernel Kernel.control_handlers (by message type)", _control_handlers),
        ("ipykernel.iostream.OutStream._fid (the captured fd's pipe, set in _setup_stream_redirects)", _out_stream_fid),
    ]


def _control_handlers() -> bool:
    from ipykernel.kernelbase import Kernel

    # A method's source, not the class's: finding a class's reads its whole module (30 ms in each worker).
    return "self.control_handlers[msg_type]" in inspect.getsource(Kernel.__init__)


def _iopub_thread_stop() -> bool:
    from ipykernel.iostream import IOPubThread

    return callable(IOPubThread.stop)


def _out_stream_fid() -> bool:
    from ipykernel.iostream import OutStream

    return "self._fid = pr" in inspect.getsource(OutStream._setup_stream_redirects)
