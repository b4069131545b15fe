"""What one controller carries: simulated engines (registration and heartbeats) against the product's controller.

The controller is started as sessions start it (control.IPyParallelControl: threads, --nodb, CurveZMQ, the
heart monitor's period and allowed misses). Each simulated engine, many per process, does to it what an
agent's engine does (ipyparallel 9's engine/app.py): a signed "registration_request" from a DEALER whose
identity is its uuid; ipyparallel's own Heart (SUB on hb_ping forwarding pings, in C, to a DEALER on hb_pong);
and, idle, the other connections a worker holds: shell ROUTER (mux, task, a broadcast leaf), control ROUTER,
iopub XPUB, and the agent's watchdog SUB on hb_ping, whose pings are counted (the rate engines really get).

At each size (product's period), then at the largest for shorter periods: launch -> all registered (the
session's own notifications), the controller's CPU (% of one core: the hub process, which runs the hub and,
with threads, the schedulers; the heart monitor, a process of its own), CPU per heartbeat, RSS and
descriptors per engine, late and stale pongs (the heart monitor's WARN log) and engines declared dead.
--real measures local workers (real agents) the same way, to check the simulation against them.

    python bench/control_plane_model.py [--sizes 8 64 256 1024] [--periods 100 50 20 10] [--idle 10] [--real 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import psutil
import zmq
from ipyparallel.controller.heartmonitor import Heart
from jupyter_client.session import Session as Signer

from cmlcluster import Session
from cmlcluster.control import connection
from cmlcluster.control import plane as control
from cmlcluster.wire import CONNECTION_ENV, HEARTBEAT_MS

PER_PROCESS = 256  # simulated engines per process (each has a heart thread and ~9 connections)
# The hub forgets a registration whose heart it has not heard within its registration_timeout (30 s): an
# engine it did not announce by then never will be.
REGISTRATION_STALL = 35.0
LOCAL_SILENCE = 10.0  # the local backend's silence_timeout; misses allowed = ceil((10 + 10) s / period)
# What the heart monitor logs at WARN (the product's level) about a pong: answering the previous ping (late,
# still counted as a beat), or an older one (stale: the beat is missed).
LATE = b"missed a beat, and took"
STALE = b"got bad heartbeat"


class SimulatedEngine:
    """One engine's sockets to the controller, as ipyparallel's IPEngine opens them."""

    def __init__(self, context, info: dict) -> None:
        self.info = info
        scheme, pack, unpack = info["signature_scheme"], info["pack"], info["unpack"]
        self.session = Signer(key=info["key"].encode(), signature_scheme=scheme, packer=pack, unpacker=unpack)
        self.ident = self.session.session
        self.server_key = (info.get("curve_serverkey") or "").encode() or None
        self.public, self.secret = zmq.curve_keypair()  # every engine makes its own (IPEngine._ensure_curve_keypair)
        self.context = context
        self.registrar = self._socket(zmq.DEALER, "registration")
        self.watch = self._socket(zmq.SUB, "hb_ping")
        self.watch.setsockopt(zmq.SUBSCRIBE, b"")

    def _url(self, channel: str, port: int | None = None) -> str:
        return f"{self.info['interface']}:{port if port is not None else self.info[channel]}"

    def _socket(self, kind: int, *channels: str):
        socket = self.context.socket(kind)
        socket.linger = 0
        if kind in (zmq.DEALER, zmq.ROUTER, zmq.XPUB):
            socket.IDENTITY = self.ident.encode()
        if self.server_key:
            socket.curve_serverkey, socket.curve_publickey = self.server_key, self.public
            socket.curve_secretkey = self.secret
        for channel in channels:
            socket.connect(self._url(channel))
        return socket

    def request(self) -> None:
        self.session.send(self.registrar, "registration_request", content={"uuid": self.ident})

    def complete(self, frames: list[bytes]) -> None:
        """What IPEngine.complete_registration opens, and its heart."""
        _, message = self.session.feed_identities(frames)
        content = self.session.deserialize(message)["content"]
        if content["status"] != "ok":
            raise RuntimeError(f"registration refused: {content}")
        self.id = content["id"]
        broadcast = self.info["broadcast"][self.id % len(self.info["broadcast"])]
        self.shell = self._socket(zmq.ROUTER, "mux", "task")
        self.shell.connect(self._url("broadcast", broadcast))
        self.control = self._socket(zmq.ROUTER, "control")
        self.iopub = self._socket(zmq.XPUB, "iopub")
        heart = Heart(
            self._url("hb_ping"),
            self._url("hb_pong"),
            heart_id=self.ident.encode(),
            curve_serverkey=self.server_key,
            curve_secretkey=self.secret,
            curve_publickey=self.public,
        )
        heart.device.context_factory = lambda: self.context  # one context (one I/O thread) per process
        heart.start()


def simulate(count: int) -> None:
    """Run `count` engines: build them, register on "go", then answer "count" with the pings received."""
    info = json.loads(os.environ[CONNECTION_ENV])
    context = zmq.Context()
    context.MAX_SOCKETS = 16 * count + 64
    engines = [SimulatedEngine(context, info) for _ in range(count)]
    print("ready", flush=True)
    assert sys.stdin.readline() == "go\n"  # the bench sends a line only once the last one is answered
    started = time.perf_counter()
    for engine in engines:
        engine.request()
    waiting = {engine.registrar: engine for engine in engines}
    poller = zmq.Poller()
    for socket in waiting:
        poller.register(socket, zmq.POLLIN)
    while waiting:
        ready = poller.poll(120_000)
        if not ready:
            raise TimeoutError(f"{len(waiting)} of {count} registrations unanswered after 120 s")
        for socket, _ in ready:
            poller.unregister(socket)
            waiting.pop(socket).complete(socket.recv_multipart())
    print(f"replied {time.perf_counter() - started:.3f}", flush=True)
    poller = zmq.Poller()
    for engine in engines:
        poller.register(engine.watch, zmq.POLLIN)
    poller.register(0, zmq.POLLIN)
    pings = 0
    while True:
        for socket, _ in poller.poll():
            if socket == 0:
                if not sys.stdin.readline():
                    return  # the bench closed our stdin
                print(f"pings {pings}", flush=True)
                continue
            socket.recv()  # one (zmq_poll is level-triggered: a second ping comes back at the next poll)
            pings += 1


class Meter:
    """CPU (% of one core) of groups of processes between two reads; "<name>_py": of their main threads
    (Python's: the hub's handlers, the heart monitor's pong handling), the rest is zmq's I/O (CurveZMQ)."""

    def __init__(self, groups: dict[str, list[psutil.Process]]) -> None:
        self.groups = groups
        self.last = (time.perf_counter(), self._seconds())

    def _seconds(self) -> dict[str, float]:
        seconds = {name: sum(sum(p.cpu_times()[:2]) for p in group) for name, group in self.groups.items()}
        for name, group in self.groups.items():
            threads = [t for p in group for t in p.threads() if t.id == p.pid]
            seconds[f"{name}_py"] = sum(t.user_time + t.system_time for t in threads)
        return seconds

    def read(self) -> dict[str, float]:
        (then, before), self.last = self.last, (time.perf_counter(), self._seconds())
        return {name: 100 * (self.last[1][name] - before[name]) / (self.last[0] - then) for name in before}


def controller_groups() -> dict[str, list[psutil.Process]]:
    """This process's session controller (one at a time): the hub's process and the heart monitor it forked."""
    [top] = [p for p in psutil.Process().children() if p.cmdline()[1:3] == ["-m", "cmlcluster.control.controller"]]
    return {"hub": [top], "monitor": top.children(recursive=True)}


def footprint(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """RSS (MB) of each group, and the descriptors they hold together."""
    figures = {f"{name}_mb": sum(p.memory_info().rss for p in group) / 2**20 for name, group in groups.items()}
    figures["fds"] = sum(p.num_fds() for group in groups.values() for p in group)
    return figures


class Population:
    """Simulated engines in child processes, PER_PROCESS each."""

    def __init__(self, n: int, connection: str) -> None:
        sizes = [PER_PROCESS] * (n // PER_PROCESS) + ([n % PER_PROCESS] if n % PER_PROCESS else [])
        env = dict(os.environ, **{CONNECTION_ENV: connection})
        argv = [sys.executable, os.path.abspath(__file__), "--simulate"]
        self.children = [
            subprocess.Popen([*argv, str(k)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for k in sizes
        ]
        self.processes = [psutil.Process(c.pid) for c in self.children]

    def expect(self, word: str) -> list[str]:
        answers = []
        for child in self.children:
            line = child.stdout.readline().decode().split()
            if not line or line[0] != word:
                raise RuntimeError(f"a simulator said {line!r}, not {word!r} (exit code {child.poll()})")
            answers.append(line[1] if len(line) > 1 else "")
        return answers

    def say(self, word: str) -> None:
        for child in self.children:
            child.stdin.write(f"{word}\n".encode())
            child.stdin.flush()

    def pings(self) -> int:
        self.say("count")
        return sum(int(a) for a in self.expect("pings"))

    def close(self) -> None:
        for child in self.children:
            child.stdin.close()  # its end of the conversation: it exits
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


async def simulated_run(n: int, period_ms: int, silence: float, idle: float) -> dict[str, float]:
    """One controller, n simulated engines: registration, then idle figures over `idle` seconds."""
    control.HEARTBEAT_MS = period_ms  # the bench's knob: the product pings every wire.HEARTBEAT_MS
    plane = control.IPyParallelControl(silence_timeout=silence)
    registered: dict[int, float] = {}
    unregistered: set[int] = set()

    def on_engine(kind: str, engine_id: int) -> None:
        if kind == "register":
            registered[engine_id] = time.perf_counter()
        else:
            unregistered.add(engine_id)

    plane.on_engine = on_engine
    population = None
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder:  # the controller removes it
        try:
            await plane.start("127.0.0.1", folder)
            await plane.ready()
            groups = controller_groups()
            before = footprint(groups)
            population = Population(n, plane.agent_env()[CONNECTION_ENV])
            await asyncio.to_thread(population.expect, "ready")
            meter = Meter({**groups, "sim": population.processes})
            started = time.perf_counter()
            population.say("go")
            replied = max(float(s) for s in await asyncio.to_thread(population.expect, "replied"))
            count, changed = 0, started
            while len(registered) < n and time.perf_counter() - changed < REGISTRATION_STALL:
                if len(registered) > count:
                    count, changed = len(registered), time.perf_counter()
                await asyncio.sleep(0.01)
            registering = meter.read()
            registration = max(registered.values(), default=math.nan) - started
            assert sorted(plane.client.ids) == sorted(registered), "the client's ids are the engines registered"
            await asyncio.sleep(2)  # the registration flood's last work settles
            log = os.path.join(folder, "controller.log")
            log_from, load, pings = os.path.getsize(log), os.getloadavg()[0], population.pings()
            meter.read()
            t0 = time.perf_counter()
            await asyncio.sleep(idle)
            pings = population.pings() - pings
            seconds = time.perf_counter() - t0
            idling = meter.read()
            after = footprint(groups)
            with open(log, "rb") as f:
                f.seek(log_from)
                text = f.read()
            ids, dead = len(plane.client.ids), len(unregistered)
        finally:
            if population is not None:
                population.close()
            await plane.close()
            control.HEARTBEAT_MS = HEARTBEAT_MS  # the sessions of real_run ping at the product's period
    asked = n * seconds * 1000 / period_ms  # pongs the heart monitor asked for in the window
    return {
        "n": n,
        "period": period_ms,
        "registration": registration,
        "replied": replied,
        "reg_hub": registering["hub"],
        "reg_sim": registering["sim"],
        "registered": len(registered),
        "monitor_py": idling["monitor_py"],
        "hub": idling["hub"],
        "monitor": idling["monitor"],
        "sim": idling["sim"],
        "us_per_beat": 1e4 * (idling["hub"] + idling["monitor"]) * seconds / asked,
        "beat_rate": pings / (n * seconds) / (1000 / period_ms),  # of the pings asked, what each engine got
        "late_pct": 100 * text.count(LATE) / asked,
        "stale_pct": 100 * text.count(STALE) / asked,
        "dead": dead,
        "ids": ids,
        "hub_kb": 1024 * (after["hub_mb"] - before["hub_mb"]) / n,
        "monitor_kb": 1024 * (after["monitor_mb"] - before["monitor_mb"]) / n,
        "fds_per": (after["fds"] - before["fds"]) / n,
        **after,
        "load": (load + os.getloadavg()[0]) / 2,
    }


def real_run(n: int, idle: float) -> dict[str, float]:
    """n local workers (real agents): the same controller figures at the product's period."""
    with Session("local", echo=False) as session:
        t0 = time.perf_counter()
        workers = session.launch_workers(n, cpu=0.25, memory=0.25)
        ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=600)
        launch = time.perf_counter() - t0
        for failure in ready["failures"]:  # under the machine's load a worker can fail to answer: said, not fatal
            print(f"  a worker failed: {failure.get('message', failure)[:200]}", flush=True)
        running = len(ready["workers"])
        time.sleep(2)
        groups = controller_groups()
        load, meter = os.getloadavg()[0], Meter(groups)
        time.sleep(idle)
        idling = meter.read()
        return {
            "n": running,
            "asked": n,
            "launch": launch,
            "hub": idling["hub"],
            "monitor": idling["monitor"],
            "monitor_py": idling["monitor_py"],
            "us_per_beat": 1e4 * (idling["hub"] + idling["monitor"]) / (running * 1000 / HEARTBEAT_MS),
            **footprint(groups),
            "load": (load + os.getloadavg()[0]) / 2,
        }


def columns(spec: str) -> list[tuple[str, str, str]]:  # "title:key:format ..."; "_" in a title prints " "
    return [(title.replace("_", " "), key, form) for title, key, form in (c.split(":") for c in spec.split())]


SIMULATED = columns(
    "N:n:d ms:period:d registered:registered:d replied_s:replied:.2f all_s:registration:.2f hub%:reg_hub:.0f "
    "sim%:reg_sim:.0f |_idle_hub%:hub:.1f mon%:monitor:.1f mon_py%:monitor_py:.1f us/beat:us_per_beat:.1f "
    "beats_got:beat_rate:.3f late%:late_pct:.1f stale%:stale_pct:.1f dead:dead:d hubKB/e:hub_kb:.0f "
    "monKB/e:monitor_kb:.0f fds/e:fds_per:.1f sim%:sim:.0f load:load:.1f"
)
REAL = columns(
    "real_N:asked:d running:n:d launch_s:launch:.2f idle_hub%:hub:.1f mon%:monitor:.1f mon_py%:monitor_py:.1f "
    "us/beat:us_per_beat:.1f hub_MB:hub_mb:.1f mon_MB:monitor_mb:.1f fds:fds:d load:load:.1f"
)


def header(table: list[tuple[str, str, str]]) -> None:
    print(" ".join(f"{title:>{max(5, len(title))}}" for title, _, _ in table), flush=True)


def row(table: list[tuple[str, str, str]], figures: dict[str, float]) -> None:
    print(" ".join(f"{figures[key]:>{max(5, len(title))}{form}}" for title, key, form in table), flush=True)


def marginal(what: str, small: dict[str, float], large: dict[str, float], period_ms: int = HEARTBEAT_MS) -> None:
    """What one more engine costs the controller, from the difference between two sizes."""
    engines = large["n"] - small["n"]
    cpu = (large["hub"] + large["monitor"]) - (small["hub"] + small["monitor"])
    mb = (large["hub_mb"] + large["monitor_mb"]) - (small["hub_mb"] + small["monitor_mb"])
    print(
        f"{what}, {small['n']} -> {large['n']}: {1e4 * cpu / (engines * 1000 / period_ms):.1f} us of controller CPU "
        f"per heartbeat, {1024 * mb / engines:.0f} KB and {(large['fds'] - small['fds']) / engines:.1f} "
        "descriptors per engine",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--periods", type=int, nargs="*", default=[100, 50, 20, 10], help="ms, at the largest size")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds measured with all engines idle")
    parser.add_argument("--silence", type=float, default=LOCAL_SILENCE, help="the session's silence_timeout (s)")
    parser.add_argument("--real", type=int, nargs="*", default=[], help="also this many local workers")
    parser.add_argument("--plain", action="store_true", help="without CurveZMQ: what encryption costs")
    parser.add_argument("--simulate", type=int, help=argparse.SUPPRESS)  # a child: run this many engines
    args = parser.parse_args()
    if args.simulate is not None:
        return simulate(args.simulate)
    connection.ENCRYPT = not args.plain
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; idle {args.idle:g} s; CPU: % of one core; ", end="")
    print("plain (no CurveZMQ)" if args.plain else "CurveZMQ, as sessions run")
    header(SIMULATED)
    sized = []
    for n, period in [(n, HEARTBEAT_MS) for n in args.sizes] + [(max(args.sizes), p) for p in args.periods]:
        sized.append(asyncio.run(simulated_run(n, period, args.silence, args.idle)))
        row(SIMULATED, sized[-1])
        if period == HEARTBEAT_MS:  # the product's period: every engine registered, none declared dead
            assert sized[-1]["dead"] == 0 and sized[-1]["ids"] == sized[-1]["registered"], sized[-1]
    if len(args.sizes) > 1:
        marginal("simulated", sized[0], sized[len(args.sizes) - 1])
    if args.real:
        header(REAL)
        real = []
        for n in args.real:
            real.append(real_run(n, args.idle))
            row(REAL, real[-1])
        if len(real) > 1:
            marginal("real", real[0], real[-1])


if __name__ == "__main__":
    main()
