"""An SSH worker's relay (backends/ssh_relay.py) and the session's connections to it (ssh/attach.py),
on this machine: ssh_remote runs here as it would on a host, its stdin and stdout standing in for the
ssh channel, so a dropped connection is its bridge process killed (or its pipes closed). The same over
real ssh, with network cuts: tests/integration/test_blips.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from cmlcluster.backends.ssh import relay as ssh_relay
from cmlcluster.backends.ssh.attach import LOST_HOST_EXIT, RemoteWorker
from cmlcluster.backends.ssh.relay import EXIT, GONE_EXIT, HELLO, MAGIC, NOTE, OUTPUT, RAW, FrameReader, Spool, frame

REMOTE = [sys.executable, "-m", "cmlcluster.backends.ssh.remote"]


def counting(n: int, pause: float, code: int = 0) -> str:
    loop = f"for i in range({n}):\n    print('step', i, flush=True)\n    time.sleep({pause})\n"
    return f"import sys, time\n{loop}sys.exit({code})\n"


def request(worker_id: str, program: str, silence: float = 30) -> dict:
    return {"worker_id": worker_id, "argv": ["python", "-c", program], "env": {}, "cpu": 1, "memory": 1,
            "silence_timeout": silence}  # fmt: skip


@pytest.fixture(params=["0700", "setgid"])
def host_tmp(request, tmp_path, monkeypatch):
    """The "host's" temp folder: where worker folders (and their sockets) go, for this test only; also
    a setgid one (a group's shared folder), where the folders made in it are 2700."""
    os.chmod(tmp_path, 0o2700 if request.param == "setgid" else 0o700)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def steps(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("step")]


def relay_of(bridge_pid: int) -> int:
    """The relay a bridge forked (its only child): once the bridge is gone, an orphan of this process,
    which conftest makes a child subreaper."""
    [relay] = psutil.Process(bridge_pid).children()
    return relay.pid


def how_it_ended(pid: int, folder) -> str:
    """For a failed assertion: whether the relay runs, or how it ended (an ended orphan waits here as a
    zombie until reaped), and what its "host" folder holds."""
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        ended = None
        state = "not a child of this process"
    else:
        state = "running" if ended is None else ""
    if ended is not None:
        how = {os.CLD_EXITED: "exited with", os.CLD_KILLED: "killed by signal", os.CLD_DUMPED: "dumped by signal"}
        state = f"{how.get(ended.si_code, ended.si_code)} {ended.si_status}"
    return f"relay {pid}: {state}; host folder: {sorted(p.name for p in folder.rglob('*'))}"


# ---------------------------------------------------------------- the wire


def test_frames_come_out_whole_however_the_stream_is_cut_and_login_chatter_is_kept_raw():
    stream = b"Welcome!\n" + MAGIC + frame(OUTPUT, b"step 0\n") + frame(NOTE, b"hello") + frame(EXIT, b"3")
    for cut in range(1, 12):
        reader, found = FrameReader(), []
        for at in range(0, len(stream), cut):
            found += reader.feed(stream[at : at + cut])
        raw = b"".join(p for k, p in found if k == RAW)
        rest = [(k, p) for k, p in found if k != RAW]
        assert raw == b"Welcome!\n"
        assert rest == [(HELLO, b""), (OUTPUT, b"step 0\n"), (NOTE, b"hello"), (EXIT, b"3")], cut
    with pytest.raises(ValueError, match="not the relay's"):
        FrameReader().feed(MAGIC + b"o\xff\xff\xff\xff")


def test_the_spool_keeps_the_last_bytes_by_their_offset_from_the_start():
    spool = Spool(10)
    spool.add(b"0123456789")
    spool.add(b"abcd")
    assert (spool.start, spool.end) == (4, 14)
    assert spool.read(4, 3) == b"456" and spool.read(12, 10) == b"cd"


# ---------------------------------------------------------------- the host's side alone


class Channel:
    """ssh_remote started here, its stdin and stdout what an ssh channel would carry."""

    def __init__(self, argv: list[str], first: bytes):
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.process.stdin.write(first)
        self.process.stdin.flush()
        self.reader = FrameReader()
        self.output = bytearray()
        self.notes: list[str] = []
        self.code: int | None = None

    def read_until(self, done, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, (bytes(self.output), self.notes)
            data = os.read(self.process.stdout.fileno(), 65536)
            if not data:
                return
            for kind, payload in self.reader.feed(data):
                if kind == OUTPUT:
                    self.output += payload
                elif kind == NOTE:
                    self.notes.append(payload.decode())
                elif kind == EXIT:
                    self.code = int(payload)

    def drop(self) -> None:
        """The connection drops: input and output end together, as when sshd's side goes. Output first:
        the bridge reads the end of its input as the session closing it unless its output is gone by
        then (within HANGUP_MS), and a loaded machine can put more than that between two closes (ci38)."""
        self.process.stdout.close()
        self.process.stdin.close()
        self.process.wait(10)


def test_a_worker_goes_on_without_its_connection_and_the_next_one_gets_the_rest_and_its_exit_code(host_tmp):
    first = Channel(REMOTE, json.dumps(request("r1-0", counting(20, 0.05, code=3))).encode() + b"\nfrom 0\n")
    first.read_until(lambda: first.output.count(b"\n") >= 3)
    had, relay = len(first.output), relay_of(first.process.pid)
    first.drop()
    time.sleep(1.5)  # it ends meanwhile: 20 steps of 0.05 s
    second = Channel([*REMOTE, "--attach", "r1-0"], f"from {had}\n".encode())
    second.read_until(lambda: second.code is not None)
    assert second.code is not None, how_it_ended(relay, host_tmp)
    second.process.stdin.write(b"bye\n")
    second.process.stdin.close()
    assert second.process.wait(10) == 0
    assert steps((first.output[:had] + second.output).decode()) == [f"step {i}" for i in range(20)]
    assert second.code == 3
    assert os.listdir(host_tmp) == []  # its folder and socket went with it


def test_input_that_ends_while_the_connection_holds_stops_the_worker_at_once(host_tmp):
    channel = Channel(REMOTE, json.dumps(request("r2-0", counting(1000, 0.05))).encode() + b"\nfrom 0\n")
    channel.read_until(lambda: b"step 2" in channel.output)
    started = time.monotonic()
    channel.process.stdin.close()  # the session died: its end of the pipe closed, the connection holds
    channel.read_until(lambda: channel.code is not None)
    assert channel.code == 128 + signal.SIGTERM and time.monotonic() - started < 10
    assert channel.process.wait(10) == 0
    assert os.listdir(host_tmp) == []


def test_no_connection_within_silence_timeout_stops_the_worker_and_then_it_is_gone(host_tmp):
    channel = Channel(REMOTE, json.dumps(request("r3-0", counting(1000, 0.05), silence=1)).encode() + b"\nfrom 0\n")
    channel.read_until(lambda: b"step 2" in channel.output)
    channel.drop()
    deadline = time.monotonic() + 20
    while os.listdir(host_tmp):
        assert time.monotonic() < deadline, os.listdir(host_tmp)
        time.sleep(0.1)
    late = subprocess.run([*REMOTE, "--attach", "r3-0"], input=b"from 0\n", capture_output=True, timeout=30)
    assert late.returncode == GONE_EXIT and b"no longer on this host" in late.stderr


def test_output_beyond_what_the_host_keeps_is_said_to_be_lost_where_it_was(tmp_path, monkeypatch):
    monkeypatch.setattr(ssh_relay, "SPOOL_BYTES", 4096)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    monkeypatch.chdir(tmp_path)  # by its name in the folder, as the host binds it: tmp_path may be too long
    listener.bind("a.sock")
    listener.listen(1)
    ours, theirs = socket.socketpair()
    relay = ssh_relay.Relay(theirs, listener, silence_timeout=30)
    read_end, write_end = os.pipe()
    program = "import sys, time\ntime.sleep(0.5)\nsys.stdout.write('x' * 100000 + '\\nend\\n')\n"
    process = subprocess.Popen([sys.executable, "-c", program], stdout=write_end)
    os.close(write_end)
    relay.watch(process, read_end, lambda grace: process.kill())
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    ours.sendall(b"from 0\n")
    assert ours.recv(len(MAGIC)) == MAGIC
    ours.close()  # dropped before any output: all 100 kB come while no one is connected
    process.wait(10)
    deadline = time.monotonic() + 10  # the relay has read the whole pipe: the loss is all before the reconnect
    while relay.output_fd != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.connect("a.sock")
    again.sendall(b"from 0\n")
    reader, found = FrameReader(), []
    while not any(kind == EXIT for kind, _ in found):
        found += reader.feed(again.recv(65536))
    again.sendall(b"bye\n")
    thread.join(10)
    [note] = [p.decode() for k, p in found if k == NOTE]
    output = b"".join(p for k, p in found if k == OUTPUT)
    assert note.startswith(f"{100005 - 4096:,} bytes of output lost here") and output.endswith(b"\nend\n")
    assert len(output) == 4096
    again.close()
    listener.close()


# ---------------------------------------------------------------- the session's side


def local_ssh(*command: str, connect_timeout: int = 10) -> list[str]:
    """What the session runs to reach its "host": this machine, without ssh."""
    return [sys.executable, *command[1:]]


def remote_worker(tmp_path, ssh=local_ssh, silence: float = 30, keepalive: float = 0) -> RemoteWorker:
    return RemoteWorker("s1-0", "the-host", ssh, python=sys.executable, log_path=str(tmp_path / "logs" / "s1-0.log"),
                        silence=silence, keepalive=keepalive)  # fmt: skip


def test_the_session_connects_again_when_its_connection_is_killed_and_the_log_has_each_line_once(host_tmp):
    async def scenario() -> tuple[int, RemoteWorker]:
        worker = remote_worker(host_tmp)
        await worker.start(request("s1-0", counting(40, 0.05)))
        while b"step 5" not in (host_tmp / "logs" / "s1-0.log").read_bytes():
            await asyncio.sleep(0.05)
        relays.append(relay_of(worker.link.process.pid))
        os.kill(worker.link.process.pid, signal.SIGKILL)  # as `kill -9` of the session's ssh client
        return await worker.finished(), worker

    relays: list[int] = []
    code, worker = asyncio.run(scenario())
    log = (host_tmp / "logs" / "s1-0.log").read_text()
    assert code == 0 and worker.reconnections == 1, (log, how_it_ended(relays[0], host_tmp))
    assert steps(log) == [f"step {i}" for i in range(40)], log
    assert "the SSH connection to the-host dropped (ssh was killed by signal 9)" in log
    assert "connected to the-host again" in log
    assert [name for name in os.listdir(host_tmp) if name != "logs"] == []


def test_the_session_gives_up_after_silence_timeout_and_says_why(host_tmp, tmp_path_factory):
    # An "ssh" that reaches the relay once, then never again, as a host whose network went.
    script = tmp_path_factory.mktemp("ssh") / "ssh.py"
    script.write_text(
        "import os, sys\n"
        "if '--attach' in sys.argv:\n"
        "    sys.stderr.write('ssh: connect to host the-host port 22: Connection timed out\\n'); sys.exit(255)\n"
        f"os.write(1, {MAGIC!r})\n"
        "sys.stderr.write('Timeout, server the-host not responding.\\n'); sys.exit(255)\n"
    )

    def unreachable(*command: str, connect_timeout: int = 10) -> list[str]:
        return [sys.executable, str(script), *command[1:]]

    async def scenario() -> tuple[int, float, RemoteWorker]:
        worker = remote_worker(host_tmp, unreachable, silence=3, keepalive=1)
        started = time.monotonic()
        await worker.start(request("s1-0", "pass"))
        return await worker.finished(), time.monotonic() - started, worker

    code, took, worker = asyncio.run(scenario())
    assert code == LOST_HOST_EXIT and 1 < took < 15, took
    assert worker.reason == (
        "lost the SSH connection to the-host and could not connect again within silence_timeout (3 s): Timeout, "
        "server the-host not responding; last try: ssh: connect to host the-host port 22: Connection timed out"
    )
