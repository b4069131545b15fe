"""The control plane: how the session talks to its workers once they run.

The real one is ipyparallel: the session owns a controller process, every
worker's agent connects an engine to it, and the session holds a Client.
Registration notifications tell the session a worker is up; apply requests
ask its address and run its program; iopub streams carry its output live, and each
agent's resource samples (usage.py).

The fake backend brings a control plane of its own (see backends/fake.py), so
the session is written against the small interface below.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _lifeline
from .._proc import python_module
from ..errors import ControllerError
from ..lines import OutputRelay
from ..ports import ports_to_listen_on
from ..wire import (
    CONNECTION_ENV,
    CONTROLLER_START_TIMEOUT,
    DEFAULT_SILENCE_TIMEOUT,
    HEARTBEAT_MS,
    LOG_LEVEL_ENV,
    SILENCE_ENV,
    USAGE_TOPIC,
    XRAY_REQUEST,
)
from ..workers import Program
from . import ipyparallel_internals
from .connection import CLIENT_CHANNELS, CLIENT_IP, ENGINE_CHANNELS, Keys, connection_files, write_private
from .controller import LISTENING_FILE

# The hub unregisters an engine silent for the session's silence_timeout plus this: by then its agent
# has given up (it ends the worker at silence_timeout) and its backend has seen the worker's exit,
# which says more. ipyparallel never takes an unregistered engine back.
HUB_SILENCE_MARGIN = 10.0
# A registered engine silent this long since the latest first answer of any engine is failed: while
# others answer (64 local workers on 2 cores: over 10 s in all), it is waiting its turn, not hung.
DESCRIBE_TIMEOUT = 10.0
DESCRIBE_LIMIT = 120.0  # an engine's first answer, however busy the control plane is (describe)
# How often, at most, the session asks the hub for the engines it registered (the first ask 0.25 s
# after connecting, then twice as long each time up to this): control/plane.py's _catch_up says why.
HUB_RECHECK_SECONDS = 4.0
# A call's result can come before the last of its output (the reply travels on the shell channel, output
# on iopub): its end waits for the engine's idle status, which follows all of it, as long as the iopub
# channel moves, and at most OUTPUT_DRAIN_TIMEOUT s of its silence or OUTPUT_DRAIN_LIMIT s in all.
OUTPUT_DRAIN_TIMEOUT = 5.0
OUTPUT_DRAIN_LIMIT = 120.0
INTERRUPT_TIMEOUT = 5.0  # seconds for an agent's control thread to answer an interrupt request

EngineCallback = Callable[[str, int], None]  # ("register" | "unregister", engine id)
OutputCallback = Callable[[str, str], None]  # (stream name, text)
UsageCallback = Callable[[int, dict[str, Any]], None]  # (engine id, a resource sample's content: usage.decode)


@dataclass(frozen=True)
class WorkerInfo:
    ip_address: str | None
    hostname: str | None
    pid: int | None


class ControlPlane(abc.ABC):
    """What the session needs from a control plane. Callbacks run on the session's loop."""

    on_engine: EngineCallback | None = None
    on_usage: UsageCallback | None = None  # a worker's agent sent a resource sample (usage.py)

    @abc.abstractmethod
    async def start(self, listen_ip: str, session_dir: str) -> None:
        """Start the control plane; return once agent_env() is known, maybe before it serves."""

    async def ready(self) -> None:  # noqa: B027 - a plane whose start returns ready has nothing to wait for
        """Return once the control plane serves (engines register and are announced); idempotent."""

    @abc.abstractmethod
    def agent_env(self) -> dict[str, str]:
        """Environment every worker's agent needs to connect: data, never a path on the session's disk."""

    @abc.abstractmethod
    async def describe(self, engine_id: int) -> WorkerInfo: ...

    @abc.abstractmethod
    async def run_program(self, engine_id: int, program: Program, on_output: OutputCallback) -> int:
        """Run the program on the engine; return its exit code once all its output has arrived."""

    @abc.abstractmethod
    async def call(self, engine_id: int, target: str, args: tuple[Any, ...], on_output: OutputCallback) -> Any:
        """Call "module:function"(*args) in the worker and return its result; its output goes to on_output.

        An exception raised there is raised here as a RemoteError carrying the remote traceback.
        """

    @abc.abstractmethod
    async def interrupt(self, engine_id: int) -> None:
        """End the worker's running program as a stop does (run_program returns its exit code, -signal),
        its agent still serving; nothing when no program runs."""

    @abc.abstractmethod
    async def xray(self, engine_id: int) -> dict[str, Any]:
        """The stacks of the worker's program and of every rank below its agent, gathered while they run
        (stacks/gather.py's answer); the caller bounds the wait."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    def client(self) -> Any:
        return None


def heart_monitor_args(silence_timeout: float) -> list[str]:
    """The controller's heartbeat options: a ping every HEARTBEAT_MS, and an engine unregistered once
    silent for silence_timeout + HUB_SILENCE_MARGIN seconds."""
    misses = math.ceil((silence_timeout + HUB_SILENCE_MARGIN) * 1000 / HEARTBEAT_MS)
    return [f"--HeartMonitor.period={HEARTBEAT_MS}", f"--HeartMonitor.max_heartmonitor_misses={misses}"]


def _agent_call(name: str, *args: Any) -> Any:
    """Runs on an engine: call a function of the worker's agent module.

    Only this small function travels as code; everything it calls is imported
    in the worker, so it always matches the worker's installed cmlcluster.
    """
    from cmlcluster.agent import main as agent

    return getattr(agent, name)(*args)


class IPyParallelControl(ControlPlane):
    def __init__(self, silence_timeout: float = DEFAULT_SILENCE_TIMEOUT) -> None:
        """silence_timeout: the session's (seconds); its agents and its hub allow that much silence."""
        self.silence_timeout = silence_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client_file = ""
        self._log_path = ""
        self._listening_file = ""
        self._connection = ""
        self._registered: set[int] = set()
        self._unregistered: set[int] = set()
        self._last_first_answer = -math.inf  # loop time: describe's deadline counts from it
        # time.monotonic() (the loop's clock) of the last output any engine's program sent: a control plane
        # that carries a flood of it is busy, not stalled (describe).
        self._last_news = -math.inf
        self._ready: asyncio.Future[None] | None = None
        self._catching_up: asyncio.Task[None] | None = None

    @property
    def client(self) -> Any:
        return self._client

    async def start(self, listen_ip: str, session_dir: str) -> None:
        # The connection files are written here, before the controller runs (it reads them:
        # reuse_files), so that workers can start while it does: its start was most of one
        # worker's launch.
        self._loop = asyncio.get_running_loop()
        profile_dir = os.path.join(session_dir, "ipython")
        security = os.path.join(profile_dir, "security")
        os.makedirs(security, mode=0o700, exist_ok=True)
        self._client_file = os.path.join(security, "ipcontroller-client.json")
        self._log_path = os.path.join(session_dir, "controller.log")
        self._listening_file = os.path.join(session_dir, LISTENING_FILE)
        with contextlib.suppress(FileNotFoundError):  # a controller of this session's that failed
            os.remove(self._listening_file)
        ports = ports_to_listen_on(1 + len(ENGINE_CHANNELS) + len(CLIENT_CHANNELS))  # 1: registration
        keys = Keys.new()
        engine, client = connection_files(listen_ip, ports, keys)
        write_private(os.path.join(security, "ipcontroller-engine.json"), engine)
        write_private(self._client_file, client)
        self._connection = json.dumps(engine)
        argv = [
            *python_module("cmlcluster.control.controller"),  # the notebook's folder not on its sys.path
            f"--profile-dir={profile_dir}",
            "--IPController.reuse_files=True",
            # As in the files; the hub reads its registration addresses from these (a second
            # binding of the registration port, for workers, only when they differ).
            f"--IPController.engine_ip={listen_ip}",
            f"--IPController.client_ip={CLIENT_IP}",
            "--IPController.use_threads=True",
            *keys.controller_args(),
            *heart_monitor_args(self.silence_timeout),
            "--nodb",  # results live in the session, not in the controller's memory
            f"--log-level={os.environ.get(LOG_LEVEL_ENV, 'WARN')}",
        ]
        with open(self._log_path, "ab") as log:
            # stdin is the lifeline (see control/controller.py); never closed until close().
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, CMLCLUSTER_SESSION_DIR=session_dir, **keys.controller_env()),
            )
        _lifeline.guard_stdin(self._process)

    async def ready(self) -> None:
        if self._ready is None:  # one connection, however many launches wait for it
            self._ready = asyncio.ensure_future(self._connect_when_serving())
        await asyncio.shield(self._ready)

    async def _connect_when_serving(self) -> None:
        try:
            await self._wait_listening()
            await asyncio.to_thread(self._connect, self._client_file)  # it sets self._client
        except BaseException:
            await self.close()
            raise
        # Engines that registered before the client connected were never announced to it.
        for engine_id in self._client.ids:
            self._announce("register", engine_id)
        self._catching_up = asyncio.ensure_future(self._catch_up())

    async def _catch_up(self) -> None:
        """Announce the engines the hub registered that the client never heard of, for the client's life.

        ipyparallel's client asks the hub for its engines and only then subscribes to its registration
        notifications, on a PUB socket that drops what it sends before the subscription arrives: an
        engine that registers in between is announced to no one, ever (ci44, ci47: a worker started
        with the session's controller was "still scheduling after 60 s", its heart beating). The hub
        is asked again soon after connecting, when that can happen, and then every few seconds: any
        notification lost later (a reconnect) is made good too. One small request each time.
        """
        client = self._client
        pause = 0.25
        while True:
            await asyncio.sleep(pause)
            pause = min(2 * pause, HUB_RECHECK_SECONDS)
            try:
                engines = await ipyparallel_internals.hub_engines(client, HUB_RECHECK_SECONDS)
            except asyncio.TimeoutError:
                continue  # a hub too busy to answer now: asked again, later
            except Exception:  # the client closed meanwhile (close() cancels this task, too)
                return
            known = self._registered | self._unregistered
            missed = {engine_id: uuid for engine_id, uuid in engines.items() if engine_id not in known}
            if missed:
                ipyparallel_internals.register_engines(client, missed)

    async def _wait_listening(self) -> None:
        assert self._process is not None and self._loop is not None
        deadline = self._loop.time() + CONTROLLER_START_TIMEOUT
        # control/controller.py says when its hub listens; there is no event to wait on.
        while not os.path.exists(self._listening_file):
            if self._process.poll() is not None:
                raise ControllerError(
                    f"the ipyparallel controller exited with code {self._process.returncode} "
                    f"before it was ready:\n{_tail(self._log_path)}"
                )
            if self._loop.time() > deadline:
                raise ControllerError(
                    f"the ipyparallel controller was not ready after {CONTROLLER_START_TIMEOUT:g} s:\n"
                    f"{_tail(self._log_path)}"
                )
            await asyncio.sleep(0.02)

    def _connect(self, client_file: str) -> None:
        import ipyparallel

        ipyparallel_internals.probe_client()
        client = ipyparallel.Client(client_file, timeout=30)
        # Before the first registration can be heard: the session's loop may announce it (and describe the
        # engine through this client) before this thread's return reaches it (ci: "'NoneType' object has no
        # attribute 'send_apply_request'", a healthy worker failed).
        self._client = client
        # ipyparallel's own wait_for_engines uses this hook; it is the only way to
        # hear of registrations as they happen rather than by polling client.ids.
        ipyparallel_internals.registration_callbacks(client).append(self._on_registration)
        ipyparallel_internals.route_iopub_topic(client, USAGE_TOPIC, self._on_usage_message)

    def _on_registration(self, event: dict[str, Any]) -> None:
        # Runs on the client's IO thread.
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._announce, event["event"], int(event["id"]))

    def _on_usage_message(self, message: dict[str, Any]) -> None:
        # Runs on the client's IO thread: one sample per worker every few seconds. (No news for describe:
        # a hung engine's own sampler would keep its deadline moving.)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._usage, message["content"])

    def _usage(self, content: dict[str, Any]) -> None:
        if self.on_usage is not None and isinstance(content, dict) and isinstance(content.get("engine"), int):
            self.on_usage(content["engine"], content)

    def _announce(self, kind: str, engine_id: int) -> None:
        # On the session's loop. An engine that registers while the client connects is both in
        # the client's first list and in a notification: announced once.
        if kind == "register":
            if engine_id in self._registered:
                return
            self._registered.add(engine_id)
        else:
            self._unregistered.add(engine_id)
        if self.on_engine is not None:
            self.on_engine(kind, engine_id)

    def agent_env(self) -> dict[str, str]:
        return {CONNECTION_ENV: self._connection, SILENCE_ENV: str(float(self.silence_timeout))}

    def _apply(
        self, engine_id: int, args: tuple[Any, ...], on_iopub: Callable[[dict[str, Any]], None] | None = None
    ) -> Any:
        """Send one apply request to one engine; on_iopub sees its output from the first byte. Returns the
        request's own future (its `output` resolves once the output is all in) and its value's."""
        client = self._client

        def hook(message_future: Any) -> None:
            # Called before the request is sent, so no output can be missed.
            if on_iopub is not None:
                message_future.iopub_callbacks.append(on_iopub)

        # Send through the mux *stream*, as ipyparallel's own DirectView does, never on the raw
        # _mux_socket: the client's IO thread reads replies from that socket through a ZMQStream,
        # and a raw send runs libzmq's command processing, which can consume the socket's
        # edge-triggered ZMQ_FD wake-up. A reply that arrives in that window then sits unread;
        # the pipe never reports "readable" again, so every later reply of the session is stuck
        # behind it (the stall after N launches). The stream re-reads ZMQ_EVENTS after each of
        # its own sends. Same mechanism as ipykernel#1529 / ipykernel#1554 on the kernel side.
        future = client.send_apply_request(
            ipyparallel_internals.mux_stream(client),
            _agent_call,
            list(args),
            ident=ipyparallel_internals.engine_ident(client, engine_id),
            message_future_hook=hook,
        )
        return future, ipyparallel_internals.reply_value(future)

    async def describe(self, engine_id: int) -> WorkerInfo:
        # The hub announces an engine once its heart beats, but under load the engine's
        # shell socket can connect later, and ipyparallel's router drops what is sent to
        # it before then. describe is idempotent, so on silence ask again, with backoff.
        # Its deadline counts from the latest sign that the control plane moves: another engine's first
        # answer, or any program's output reaching the session. At 1,024 workers that all
        # printed, a healthy worker's answer waited 11 s behind their output and was failed (issue 38);
        # while the plane carries such a flood an engine gets up to DESCRIBE_LIMIT.
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        asked: set[asyncio.Future[Any]] = set()
        silence = 0.5

        def deadline() -> float:
            moved = max(asked_at, self._last_first_answer, self._last_news)
            return min(asked_at + DESCRIBE_LIMIT, moved + DESCRIBE_TIMEOUT)

        try:
            while (until := deadline()) > loop.time():
                _, result = self._apply(engine_id, ("describe",))
                asked.add(asyncio.wrap_future(result))
                wait = max(0.0, min(silence, until - loop.time()))
                done, asked = await asyncio.wait(asked, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if done:
                    info = done.pop().result()
                    self._last_first_answer = loop.time()
                    return WorkerInfo(**{key: info.get(key) for key in ("ip_address", "hostname", "pid")})
                silence = min(silence * 2, 4.0)
            waited = loop.time() - asked_at
            if waited >= DESCRIBE_LIMIT:
                why = f"{waited:.0f} s, the most it is given while other engines' output kept the controller busy"
            else:
                why = f"{waited:.0f} s, {DESCRIBE_TIMEOUT:g} s of them while no other engine answered or sent output"
            raise TimeoutError(f"engine {engine_id} did not answer for {why}")
        finally:
            # Requests abandoned here are cancelled, so that their late failure (the engine
            # dies; the hub reports "Engine died while running task") is never left unretrieved.
            for unanswered in asked:
                unanswered.cancel()

    async def _apply_streaming(self, engine_id: int, args: tuple[Any, ...], on_output: OutputCallback) -> Any:
        loop = asyncio.get_running_loop()
        client = self._client

        relay = OutputRelay(loop, on_output)

        def on_iopub(msg: dict[str, Any]) -> None:
            self._last_news = time.monotonic()  # on the client's IO thread; describe reads it
            if msg["header"]["msg_type"] == "stream":
                content = msg["content"]
                # Dropped from the client before the session has it: whoever sees the text (on the session's
                # loop, or a subscriber's thread) never finds the client still holding it (ci43).
                ipyparallel_internals.forget_stream_text(client, msg)
                relay.put(content["name"], content["text"])

        future, result = self._apply(engine_id, args, on_iopub)
        try:
            value = await asyncio.wrap_future(result)
        except asyncio.CancelledError:
            raise  # given up on (its worker ended): no output to wait for
        except BaseException:
            await self._drain(future)  # a failure's traceback, if its engine lives to send it
            raise
        await self._drain(future, relay)
        return value

    async def _drain(self, future: Any, relay: OutputRelay | None = None) -> None:
        """Until the call's output is all in: ipyparallel resolves `output` on the engine's idle status.
        At 1,024 workers printing, the session's iopub ran more than a fixed 5 s behind the replies, and
        every program's last lines were lost, without a word (bench/printing_model.py): the wait counts
        from the latest iopub message, not from the reply. Given up, `relay`'s output says so (a call that
        returned: its engine lives, so its output is late, not ended with a dead engine)."""
        loop = asyncio.get_running_loop()
        output = asyncio.ensure_future(asyncio.wrap_future(future.output))
        started = loop.time()
        while not output.done():
            until = min(started + OUTPUT_DRAIN_LIMIT, max(started, self._last_news) + OUTPUT_DRAIN_TIMEOUT)
            if until <= loop.time():
                output.cancel()
                if relay is not None:
                    waited = loop.time() - started
                    relay.put("stderr", f"[cmlcluster: the rest of this output did not arrive within {waited:.0f} s]\n")
                return
            await asyncio.wait([output], timeout=until - loop.time())

    async def run_program(self, engine_id: int, program: Program, on_output: OutputCallback) -> int:
        args = (
            "run_program",
            *(program.script, program.code, program.target, program.args, program.files, program.files_in_cwd),
        )
        return int(await self._apply_streaming(engine_id, args, on_output))

    async def call(self, engine_id: int, target: str, args: tuple[Any, ...], on_output: OutputCallback) -> Any:
        return await self._apply_streaming(engine_id, ("call", target, *args), on_output)

    async def interrupt(self, engine_id: int) -> None:
        reply = ipyparallel_internals.send_control_request(self._client, engine_id, "interrupt_request")
        await asyncio.wait_for(asyncio.wrap_future(reply), INTERRUPT_TIMEOUT)

    async def xray(self, engine_id: int) -> dict[str, Any]:
        reply = ipyparallel_internals.send_control_request(self._client, engine_id, XRAY_REQUEST)
        [message] = await asyncio.wrap_future(reply)
        content: dict[str, Any] = message["content"]
        if content.get("status") != "ok":
            raise ControllerError(f"its agent could not gather its stacks: {content.get('error')}")
        return content

    async def close(self) -> None:
        if self._catching_up is not None:
            self._catching_up.cancel()
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close, linger=0)
        process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None
            process.stdin.close()  # pull the lifeline: the controller's group is SIGKILLed
            try:
                await asyncio.to_thread(process.wait, 10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                await asyncio.to_thread(process.wait)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
