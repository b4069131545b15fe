"""1,024 workers that all print, against a real session, on a machine too small for 1,024 real agents.

Issue 38 measured 1,024 real local workers on a 16-core machine: while every worker printed 20 lines a
second, a healthy worker was failed ("registered with the controller but did not answer"), one call_each
to all of them took 2,288 ms, and the widget fell to 5.5 updates a second. This machine cannot start
1,024 agents (each is a Python process with a kernel), so this bench keeps everything of the session's
side real and simulates only the agents:

- real: the Session (supervisor, event bus, the session's record, the straggler and idle watches), its
  controller (hub, schedulers, heart monitor, CurveZMQ), the ipyparallel client and the session's control
  plane on it (describe's deadline, OutputRelay), and a WidgetView rendering all N rows;
- simulated (SIMULATE_PER_PROCESS engines per child process, one zmq poll loop each): every worker's
  engine, as control_plane_model.SimulatedEngine registers it (ipyparallel's own Heart, the controller
  watch's SUB), plus what the session asks of it. An apply request is unpacked as ipyparallel's kernel
  unpacks it; `describe` answers as the agent does, `call` runs the target (agent/program.call), and
  `run_program` prints: lines at PRINT_RATE a second as ipykernel's OutStream sends them (one `stream`
  message per 0.2 s flush, all lines written since), between `busy` and `idle` status messages, then the
  reply with exit code 0. Each engine sends a resource sample every wire.DEFAULT_USAGE_SECONDS.

What it leaves out: the agents' own CPU (1,024 real agents on 16 cores compete with the session; here
the simulators cost a fraction of that), and a stopped engine's heart beats on until its simulator ends
(the hub carries N hearts all along: the heavier case).

For each size N (default 16, 64, 256, 1024), one session:
1. N idle workers: launch -> all running; call_each to all (at least CALLS times, at least REQUESTS requests):
   its median wall time, and each process group's CPU per worker per call, idle work subtracted, against the
   smallest N (the goal: growth no faster than N, a ratio near 1), and the full collections it caused;
2. N workers that each print PRINT_RATE lines a second for --print-seconds, then END: launch -> all
   running (every registration and describe happens while the earlier workers print, the case that
   failed a worker), the widget's updates a second and render times while all print, false failures
   (any worker not `succeeded`), and workers whose output does not end with END.

    python bench/printing_model.py [--sizes 16 64 256 1024] [--print-seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import heapq
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil
import zmq
from control_plane_model import SimulatedEngine  # this folder's: registration and heart as IPEngine's
from ipyparallel.serialize import serialize_object, unpack_apply_message

from cmlcluster import Session
from cmlcluster.agent.program import call
from cmlcluster.backends.base import Backend, Capabilities
from cmlcluster.backends.local import LOCAL_SILENCE_TIMEOUT
from cmlcluster.events import OutputLine
from cmlcluster.ui.widget import WidgetView
from cmlcluster.usage import encode as usage_content
from cmlcluster.wire import CONNECTION_ENV, DEFAULT_USAGE_SECONDS, USAGE_MSG_TYPE, USAGE_TOPIC
from cmlcluster.workers import WorkerSpec

SIMULATE_PER_PROCESS = 256
PRINT_RATE = 20  # lines a second per worker, as bench/scale.py's workers print
FLUSH_SECONDS = 0.2  # ipykernel's OutStream.flush_interval: what a program prints leaves in messages this often
PRINT_ENV = "MODEL_PRINT_SECONDS"  # how long a worker's program prints (its env, so each launch says)
CALLS = 5  # call_each to all, at least; at small sizes as many as make REQUESTS requests (CPU clocks tick in 10 ms)
REQUESTS = 5120
WIDGET_SECONDS = 5.0  # the widget's updates and renders are measured this long, while every worker prints
IDLE_SECONDS = 5.0  # what each process spends with every worker idle, measured before the calls
LAST_LINE = "END"


# ---------------------------------------------------------------- the simulator (a child process)


class WorkingEngine(SimulatedEngine):
    """One worker's engine: registers as the agent does (with the id the session gave it) and answers."""

    def __init__(self, context: zmq.Context, info: dict[str, Any], worker_id: str, engine_id: int, env: dict) -> None:
        super().__init__(context, info)
        self.worker_id, self.engine_id = worker_id, engine_id
        self.print_seconds = float(env.get(PRINT_ENV, "0"))
        self.shell: zmq.Socket | None = None
        self.program: dict[str, Any] | None = None  # the run_program request being answered, and its clock

    def request(self) -> None:
        content = {"uuid": self.ident, "id": self.engine_id}  # IPEngine.register with --IPEngine.id
        self.session.send(self.registrar, "registration_request", content=content)

    def topic(self, kind: str) -> bytes:
        return f"engine.{self.engine_id}.{kind}".encode()

    def status(self, parent: dict[str, Any], state: str) -> None:
        self.session.send(self.iopub, "status", {"execution_state": state}, parent=parent, ident=self.topic("status"))

    def answer(self, frames: list[bytes]) -> None:
        """An apply request from the session, answered as the agent's engine would."""
        idents, message = self.session.feed_identities(frames)
        request = self.session.deserialize(message)
        _, (name, *args), _ = unpack_apply_message(request["buffers"], copy=False)
        self.status(request, "busy")
        if name == "run_program":
            self.program = {"request": request, "idents": idents, "started": time.monotonic(), "printed": 0}
            return  # answered when its printing ends (tick)
        if name == "describe":
            result: Any = {"worker_id": self.worker_id, "ip_address": "127.0.0.1", "hostname": HOST, "pid": os.getpid()}
        elif name == "call":
            result = call(*args)
        else:
            raise NotImplementedError(f"the model's engines do not answer {name!r}")
        self.reply(request, idents, result)

    def reply(self, request: dict[str, Any], idents: list[bytes], result: Any) -> None:
        metadata = {"engine": self.ident, "status": "ok", "dependencies_met": True}
        assert self.shell is not None
        self.session.send(
            self.shell,
            "apply_reply",
            {"status": "ok"},
            parent=request,
            ident=idents,
            buffers=serialize_object(result),
            metadata=metadata,
        )
        self.status(request, "idle")

    def tick(self, now: float) -> bool:
        """A flush of its program's output; True while it still prints."""
        program = self.program
        if program is None:
            return False
        elapsed = now - program["started"]
        due = min(int(elapsed * PRINT_RATE), int(self.print_seconds * PRINT_RATE))
        lines = "".join(f"line {i}\n" for i in range(program["printed"], due))
        program["printed"] = due
        ended = elapsed >= self.print_seconds
        if ended:
            lines += f"{LAST_LINE}\n"
        if lines:
            self.session.send(
                self.iopub,
                "stream",
                {"name": "stdout", "text": lines},
                parent=program["request"],
                ident=self.topic("stream"),
            )
        if ended:
            self.program = None
            self.reply(program["request"], program["idents"], 0)
        return not ended

    def sample(self) -> None:
        content = {**usage_content(random.uniform(0, 100), 50 * 2**20, None, []), "engine": self.engine_id}
        self.session.send(self.iopub, USAGE_MSG_TYPE, content, ident=USAGE_TOPIC)

    def close(self) -> None:
        # Its heart (a zmq device thread) beats on until the process ends: see the module's docstring.
        for socket_ in (
            self.registrar,
            self.watch,
            self.shell,
            getattr(self, "control", None),
            getattr(self, "iopub", None),
        ):
            if socket_ is not None:
                socket_.close(linger=0)


HOST = socket.gethostname()


def simulate() -> None:
    """Engines added and stopped by the bench's lines on stdin; "ended <worker> <code>" lines on stdout."""
    context = zmq.Context()
    context.MAX_SOCKETS = 16 * SIMULATE_PER_PROCESS + 64
    poller = zmq.Poller()
    poller.register(0, zmq.POLLIN)
    by_socket: dict[zmq.Socket, tuple[str, WorkingEngine]] = {}
    engines: dict[str, WorkingEngine] = {}
    timers: list[tuple[float, int, str, str]] = []  # (when, tie, what, worker)
    tie = 0

    def later(when: float, what: str, worker: str) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(timers, (when, tie, what, worker))

    def end(worker: str, code: int) -> None:
        engine = engines.pop(worker)
        for socket_ in [s for s, (_, e) in by_socket.items() if e is engine]:
            poller.unregister(socket_)
            del by_socket[socket_]
        engine.close()
        print(f"ended {worker} {code}", flush=True)

    def add(order: dict[str, Any]) -> None:
        env = order["env"]
        engine = WorkingEngine(context, json.loads(env[CONNECTION_ENV]), order["add"], int(order["engine_id"]), env)
        engines[engine.worker_id] = engine
        engine.request()
        for role, socket_ in (("registrar", engine.registrar), ("watch", engine.watch)):
            by_socket[socket_] = (role, engine)
            poller.register(socket_, zmq.POLLIN)

    pending = b""  # what stdin holds past its last whole line (poll says readable once for all of it)
    while True:
        wait = max(0.0, timers[0][0] - time.monotonic()) if timers else 1.0
        for socket_, _ in poller.poll(1000 * wait):
            if socket_ == 0:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return  # the bench closed our stdin
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    order = json.loads(line)
                    if "add" in order:
                        add(order)
                    elif order["stop"] in engines:
                        end(order["stop"], -15)
                continue
            if socket_ not in by_socket:
                continue  # its engine was stopped by a line read in this same round
            role, engine = by_socket[socket_]
            frames = socket_.recv_multipart()
            if role == "registrar":
                poller.unregister(socket_)
                del by_socket[socket_]
                engine.complete(frames)  # opens its shell (mux, task, broadcast), control, iopub and heart
                by_socket[engine.shell] = ("shell", engine)
                poller.register(engine.shell, zmq.POLLIN)
                later(time.monotonic() + random.uniform(0, DEFAULT_USAGE_SECONDS), "sample", engine.worker_id)
            elif role == "shell":
                engine.answer(frames)
                if engine.program is not None:
                    later(time.monotonic() + FLUSH_SECONDS, "flush", engine.worker_id)
            # "watch": the agent's controller watch only counts pings
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, what, worker = heapq.heappop(timers)
            engine = engines.get(worker)
            if engine is None:
                continue  # stopped meanwhile
            if what == "sample":
                engine.sample()
                later(now + DEFAULT_USAGE_SECONDS, "sample", worker)
            elif engine.tick(now):
                later(now + FLUSH_SECONDS, "flush", worker)


# ---------------------------------------------------------------- the backend the session starts them with


class ModelBackend(Backend[str]):
    """Starts each worker as a simulated engine in a simulator process (SIMULATE_PER_PROCESS each)."""

    name = "model"

    def capabilities(self) -> Capabilities:
        return Capabilities(
            own_address=False,
            session_host=True,
            python=sys.executable,
            shared_paths=("/",),
            silence_timeout=LOCAL_SILENCE_TIMEOUT,
        )

    async def attach(self, context: Any) -> None:
        await super().attach(context)
        self._simulators: list[tuple[asyncio.subprocess.Process, asyncio.Task[None]]] = []
        self._room = 0  # engines the newest simulator may still take
        self._where: dict[str, asyncio.subprocess.Process] = {}
        self._ended: dict[str, asyncio.Future[int]] = {}
        self._starting = asyncio.Lock()  # the session starts a launch's workers at once: one simulator at a time

    async def _simulator(self) -> asyncio.subprocess.Process:
        async with self._starting:
            return await self._simulator_with_room()

    async def _simulator_with_room(self) -> asyncio.subprocess.Process:
        if self._room == 0:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                os.path.abspath(__file__),
                "--simulate",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            self._simulators.append((process, asyncio.create_task(self._read(process))))
            self._room = SIMULATE_PER_PROCESS
        self._room -= 1
        return self._simulators[-1][0]

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            _, worker, code = line.decode().split()
            self._ended[worker].set_result(int(code))
        code = await process.wait()
        for worker, where in self._where.items():  # a simulator that died ends its engines
            if where is process and not self._ended[worker].done():
                self._ended[worker].set_result(code or -9)

    def _tell(self, process: asyncio.subprocess.Process, order: dict[str, Any]) -> None:
        assert process.stdin is not None
        process.stdin.write((json.dumps(order) + "\n").encode())

    async def start(self, spec: WorkerSpec) -> str:
        process = await self._simulator()
        self._where[spec.worker_id] = process
        self._ended[spec.worker_id] = asyncio.get_running_loop().create_future()
        self._tell(process, {"add": spec.worker_id, "engine_id": spec.engine_id, "env": dict(spec.env)})
        return spec.worker_id

    async def poll(self, handle: str) -> int | None:
        ended = self._ended[handle]
        return ended.result() if ended.done() else None

    async def wait(self, handle: str) -> int:
        return await asyncio.shield(self._ended[handle])

    async def stop(self, handle: str, grace: float = 5.0) -> None:
        if not self._ended[handle].done():
            self._tell(self._where[handle], {"stop": handle})
        await asyncio.shield(self._ended[handle])

    def output(self, handle: str) -> str:
        return ""

    async def close(self) -> None:
        for process, reader in self._simulators:
            assert process.stdin is not None
            process.stdin.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), 10)
            if process.returncode is None:
                process.kill()
                await process.wait()
            await reader


# ---------------------------------------------------------------- the measurements


def process_groups() -> dict[str, list[psutil.Process]]:
    """This process (the session: its loop, the ipyparallel client's IO thread, the views), its controller
    (hub, schedulers, heart monitor) and the simulators."""
    me = psutil.Process()
    children = me.children(recursive=True)
    simulators = [p for p in children if "--simulate" in p.cmdline()]
    return {"session": [me], "controller": [p for p in children if p not in simulators], "simulators": simulators}


def cpu_seconds(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    return {name: sum(sum(p.cpu_times()[:2]) for p in group) for name, group in groups.items()}


def idle_figures(n: int) -> dict[str, float]:
    """n idle workers: launch -> all running, then call_each to all, at least CALLS times and REQUESTS requests:
    its wall time (median) and the CPU each process group spent on it per worker, less what that group spends
    idle (heartbeats, resource samples) over the same time. On 2 cores the wall time holds the contention of the
    simulated agents and the controller's idle work, both growing with N; the CPU is each one's own."""
    with Session(ModelBackend(), echo=False) as session:
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.25, memory=0.25)
        ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=600)
        launch = time.perf_counter() - t0
        running = ready["workers"]
        time.sleep(2)  # the launch's last echoes settle
        groups = process_groups()
        before, t1 = cpu_seconds(groups), time.perf_counter()
        time.sleep(IDLE_SECONDS)
        idle_seconds, idle = time.perf_counter() - t1, cpu_seconds(groups)
        calls = []
        collections = gc.get_stats()[2]["collections"]
        for _ in range(max(CALLS, REQUESTS // max(1, len(running)))):
            t = time.perf_counter()
            answers = session.call_each([(w, "os:getpid", ()) for w in running], timeout=120)
            calls.append(time.perf_counter() - t)
            assert len(answers) == len(running)
        used = cpu_seconds(groups)
        full_collections = (gc.get_stats()[2]["collections"] - collections) / len(calls)
    figures = {
        "idle_launch": launch,
        "idle_failed": n - len(running),
        "call_each_ms": 1000 * statistics.median(calls),
        "full_gc": full_collections,
    }
    for name in groups:
        idle_rate = (idle[name] - before[name]) / idle_seconds
        call_cpu = used[name] - idle[name] - idle_rate * sum(calls)
        figures[f"{name}_us"] = 1e6 * call_cpu / (len(calls) * n)  # CPU per worker per call_each
    return figures


def printing_figures(n: int, print_seconds: float) -> dict[str, float]:
    """n workers printing while a WidgetView renders them: false failures, lost ends, the widget's rate."""
    pauses: list[tuple[float, str]] = []  # the full garbage collections during the window: (seconds, thread)
    began: dict[int, float] = {}

    def collecting(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            thread = threading.get_ident()
            if phase == "start":
                began[thread] = time.perf_counter()
            elif thread in began:
                pauses.append((time.perf_counter() - began.pop(thread), threading.current_thread().name))

    with Session(ModelBackend(), echo=False) as session:
        view = WidgetView(session)
        renders: list[tuple[float, float]] = []  # (wall, CPU of the render thread)
        render = view._render  # the render thread calls it through the instance: time each call

        def timed() -> None:
            t, cpu = time.perf_counter(), time.thread_time()
            render()
            renders.append((time.perf_counter() - t, time.thread_time() - cpu))

        view._render = timed  # type: ignore[method-assign]
        heard: dict[str, int] = {}  # the program lines each worker's OutputLine events carried

        def count(event: Any) -> None:
            if isinstance(event, OutputLine) and (event.text.startswith("line ") or event.text == LAST_LINE):
                heard[event.source] = heard.get(event.source, 0) + 1

        session.subscribe(count)
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.25, memory=0.25, code="pass", env={PRINT_ENV: str(print_seconds)})
        session.await_workers(workers, wait_for_completion=False, timeout_seconds=600)
        launch = time.perf_counter() - t0
        window = min(WIDGET_SECONDS, print_seconds - launch - 1)  # while every worker prints
        if window < WIDGET_SECONDS:
            print(f"  the first workers printed for {print_seconds:g} s only: raise --print-seconds", flush=True)
            window = max(window, 1.0)
        before, t1, renders[:] = view.updates, time.perf_counter(), []
        gc.callbacks.append(collecting)
        try:
            time.sleep(window)
        finally:
            gc.callbacks.remove(collecting)
        rate = (view.updates - before) / (time.perf_counter() - t1)
        timings = list(renders)
        if pauses:
            seconds, thread = max(pauses)
            longest = f"the longest {1000 * seconds:.0f} ms on {thread}"
            print(f"  {len(pauses)} full collections while all printed, {longest}", flush=True)
        ended = session.await_workers(workers, timeout_seconds=600)
        failed = [w for w in session.list_workers() if w["status"] != "succeeded"]
        for worker in failed[:3]:
            print(f"  false failure: {worker['id']} {worker['status']}: {str(worker.get('message'))[:300]}", flush=True)
        cut = [w for w in workers if not session.output(w).rstrip().endswith(LAST_LINE)]
        printed = int(print_seconds * PRINT_RATE) + 1  # and END
        kept = sum(heard.values())
        assert not ended["failures"] or failed
    return {
        "print_launch": launch,
        "false_failures": len(failed),
        "cut_output": len(cut),
        "kept_pct": 100 * kept / (printed * n),
        "updates_per_s": rate,
        "render_ms": 1000 * statistics.median(wall for wall, _ in timings),
        "render_worst_ms": 1000 * max(wall for wall, _ in timings),
        "render_cpu_ms": 1000 * statistics.median(cpu for _, cpu in timings),
        "render_cpu_worst_ms": 1000 * max(cpu for _, cpu in timings),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--print-seconds", type=float, default=60.0, help="how long each worker prints")
    parser.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)  # a simulator child
    args = parser.parse_args(argv)
    if args.simulate:
        return simulate()
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; simulated engines, {PRINT_RATE} lines/s each")
    print(TABLE_HEADER, flush=True)
    first: dict[str, float] = {}
    for n in args.sizes:
        m = {"n": n, **idle_figures(n), **printing_figures(n, args.print_seconds)}
        first = first or m
        for name in ("call_each_ms", "session_us"):  # per worker, against the smallest size
            m[f"{name}_growth"] = (
                (m[name] / n) / (first[name] / first["n"]) if name == "call_each_ms" else m[name] / first[name]
            )
        print(TABLE_ROW.format(**m), flush=True)
    print(
        "call_each: wall time (median) and, per worker, against the smallest size; CPU per worker per call in "
        "microseconds, idle work subtracted (goal: per worker near 1, growth no faster than N); the session's "
        "full garbage collections per call. Render: wall (waits for the GIL included) and the render thread's CPU."
    )


TABLE_HEADER = (
    f"{'N':>5} {'launch s':>9} {'call_each ms':>13} {'per worker':>11} {'session us':>11} {'per worker':>11} "
    f"{'hub us':>7} {'sims us':>8} {'full GCs':>9} {'print launch s':>15} {'false failures':>15} {'cut outputs':>12} "
    f"{'lines kept %':>13} {'widget upd/s':>13} {'render ms':>10} {'worst':>6} {'render CPU ms':>14} {'worst':>6}"
)
TABLE_ROW = (
    "{n:>5} {idle_launch:>9.2f} {call_each_ms:>13.1f} {call_each_ms_growth:>11.2f} {session_us:>11.0f} "
    "{session_us_growth:>11.2f} {controller_us:>7.0f} {simulators_us:>8.0f} {full_gc:>9.1f} {print_launch:>15.2f} "
    "{false_failures:>15d} {cut_output:>12d} {kept_pct:>13.1f} {updates_per_s:>13.1f} {render_ms:>10.2f} "
    "{render_worst_ms:>6.1f} {render_cpu_ms:>14.2f} {render_cpu_worst_ms:>6.1f}"
)


if __name__ == "__main__":
    main()
