"""Another user of the machine who reaches an elastic run's rendezvous store runs nothing in it.

torch keeps an elastic run's rendezvous state in the store as a pickle, under ``torch.rendezvous.<run
id>``, and every node's agent unpickles it at each sync; the store takes SET and LIST_KEYS from anyone
who connects. Here a process of another uid (setpriv), with the system's Python and the standard library
only (the checkout may be private to the suite's user), attacks the way such a user would: it reads the
store's endpoint, and the run id if it is there, from the command lines in /proc, else lists the store's
keys, and writes a pickle whose unpickling creates a file in a folder of the test's (0700, where that uid
cannot write) under the rendezvous key, while the ranks run. Nothing is created, and the run ends ok.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from cmlcluster import Session, run_torch
from cmlcluster.events import OutputLine

pytestmark = pytest.mark.integration

# The attacker: argv = the pid whose process tree it attacks (this test's, so that no other run on the
# machine is touched), the file its payload creates, a deadline in seconds. It prints one JSON line.
# torch's TCPStore wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, TCPStoreLibUvBackend.cpp):
# a query is one byte of QueryType; the first is VALIDATE with the uint32 magic number; strings and payloads
# are a uint64 length and their bytes, native (little-endian) order. SET has no reply; GET replies with a
# payload; LIST_KEYS with an int64 count and that many strings. torch's client puts "/" before every key.
ATTACKER = r"""
import base64, json, os, pickle, re, socket, struct, sys, time

root, marker, deadline = int(sys.argv[1]), sys.argv[2], time.monotonic() + float(sys.argv[3])
VALIDATE, SET, GET, LIST_KEYS, MAGIC = 0, 1, 3, 17, 0x3C85F7CE


class Payload:
    def __reduce__(self):
        return (open, (marker, "w"))


def in_tree(pid):
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = int(re.search(r"^PPid:\s+(\d+)", f.read(), re.M).group(1))
        except (OSError, AttributeError):
            return False
    return False


def command_lines():
    for pid in os.listdir("/proc"):
        if pid.isdigit() and in_tree(int(pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    yield f.read().decode(errors="replace").split("\0")
            except OSError:
                pass


def after(argv, option):
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def sized(data):
    return struct.pack("<Q", len(data)) + data


def receive(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the store closed the connection")
        data += chunk
    return data


def receive_sized(sock):
    return receive(sock, struct.unpack("<Q", receive(sock, 8))[0])


def connect(endpoint):
    host, _, port = endpoint.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    sock.sendall(struct.pack("<BI", VALIDATE, MAGIC))
    return sock


def list_keys(sock):
    sock.sendall(bytes([LIST_KEYS]))
    return [receive_sized(sock).decode() for _ in range(struct.unpack("<q", receive(sock, 8))[0])]


report = {"endpoint": None, "run_id_on_a_command_line": None, "key": None, "written": False}
while time.monotonic() < deadline and not report["written"]:
    lines = list(command_lines())
    for argv in lines:
        report["endpoint"] = report["endpoint"] or after(argv, "--rdzv-endpoint") or after(argv, "--rdzv_endpoint")
        report["run_id_on_a_command_line"] = report["run_id_on_a_command_line"] or after(argv, "--rdzv-id")
    ranks_run = any(any(a.endswith("rank.py") for a in argv) for argv in lines)
    if report["endpoint"] and ranks_run:
        sock = connect(report["endpoint"])
        if report["run_id_on_a_command_line"]:
            report["key"] = "/torch.rendezvous." + report["run_id_on_a_command_line"]
        else:
            keys = [k for k in list_keys(sock) if re.fullmatch(r"/torch\.rendezvous\.[^./]+", k)]
            report["key"] = keys[0] if keys else None
        if report["key"]:
            payload = base64.b64encode(pickle.dumps(Payload()))  # torch's c10d backend stores base64
            sock.sendall(bytes([SET]) + sized(report["key"].encode()) + sized(payload))
            sock.sendall(bytes([GET]) + sized(report["key"].encode()))
            report["written"] = receive_sized(sock) == payload  # the SET landed (a reply follows it)
        sock.close()
    time.sleep(0.1)
print(json.dumps(report), flush=True)
"""

# Each rank waits until the attacker has written (the test makes ATTACKED), then long enough for every
# node's agent to sync the rendezvous state (each second: KEEP_ALIVE_INTERVAL) a few times.
SCRIPT = """
import os, sys, time
attacked = sys.argv[1]
deadline = time.monotonic() + 120
while not os.path.exists(attacked) and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(4)
print("rank", os.environ["RANK"], "done", flush=True)
"""


def test_a_stranger_who_writes_a_pickle_under_the_rendezvous_key_runs_nothing_and_the_run_ends_ok(tmp_path):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to become another uid")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    marker, attacked = private / "the payload ran", tmp_path / "attacked"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # The system's Python, standard library only: the checkout and its .venv may be private to this uid.
    python = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    as_stranger = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c", ATTACKER]
    attacker = subprocess.Popen(
        [*as_stranger, str(os.getpid()), str(marker), "150"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": os.environ["PATH"]},
    )
    report: dict = {}

    def read_report() -> None:
        assert attacker.stdout is not None
        line = attacker.stdout.readline()
        report.update(json.loads(line) if line else {})
        attacked.touch()  # the ranks may finish now

    reader = threading.Thread(target=read_report, daemon=True)
    reader.start()
    try:
        with Session("local", echo=False) as session:
            said: list[str] = []
            session.subscribe(lambda event: said.append(event.text) if isinstance(event, OutputLine) else None)
            result = run_torch(
                str(script), [str(attacked)], nnodes=2, max_restarts=1, join_timeout=60, session=session, echo=False
            )
        reader.join(timeout=10)
    finally:
        if attacker.poll() is None:
            attacker.kill()
        attacker.wait()
    assert report.get("written"), (report, attacker.stderr.read() if attacker.stderr else "")
    assert not marker.exists()  # torch's state holder never unpickled the stranger's bytes
    assert report["run_id_on_a_command_line"] is None  # the run id is on no command line (ps)
    run_id = report["key"].removeprefix("/torch.rendezvous.")
    assert len(run_id) == len("cmlcluster-") + 32
    assert [text for text in said if run_id in text] == []  # nor in the output
    assert result.ok, result.message
    assert result.restarts == 0
    assert any("did not sign" in text for text in said)  # a node saw the forgery, and put its state back
    texts = "\n".join(line for lines in result.output.values() for line in lines)
    assert "rank 0 done" in texts and "rank 1 done" in texts
