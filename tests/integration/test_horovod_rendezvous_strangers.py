"""An elastic Horovod run on this machine, attacked by another user: uid 65534 finds the rendezvous the way
any local user can (the ranks' shell command lines, world-readable under /proc, carry its address and port)
and PUTs a pickle whose loading would create a file in a 0700 folder of the test's, which only code running
as the session's user could. Nothing may run it, and the run still ends ok. The attack comes once both ranks
have registered with the rendezvous (so it is up, and serving), and before they end (so it still is): each
connection must be closed unread by the guard (or answered 403), never refused for want of a listener.

The attacker is the system's Python, stdlib only (the checkout and its .venv may be private to the test's
user); it reads command lines to find the run by its own script's path, and sends nothing to any other
process's server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from harness.processes import wait_until

from cmlcluster import Session
from cmlcluster.horovod import run_horovod

pytestmark = pytest.mark.integration

STRANGER = 65534
# What a client sees of a connection the guard closes unread (the unread request makes the close a reset), or
# of a request its signed scope refuses; not ConnectionRefusedError (no listener) nor a timeout.
GUARDS_ANSWERS = {"RemoteDisconnected", "ConnectionResetError", "BrokenPipeError", 403}

# Says it is READY (hvd.elastic.run has registered the rank with the rendezvous before it calls train), then
# waits for GO before returning, so that the attacker meets a live rendezvous.
TRAIN = """\
import os, sys, time
import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
state = hvd.elastic.TensorFlowState([tf.Variable(0.0)], rounds=0)


@hvd.elastic.run
def train(state):
    open(os.path.join(sys.argv[2], f"ready-{hvd.rank()}"), "w").close()
    deadline = time.monotonic() + 180
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    state.rounds += 1
    state.commit()
    print(f"trained rank {hvd.rank()} of {hvd.size()}", flush=True)


train(state)
"""

ATTACK = r"""
import base64, hashlib, hmac, http.client, json, os, pickle, re, sys, time

script, marker, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])


class Payload:
    def __reduce__(self):
        return (open, (marker, "w"))  # runs wherever the bytes are unpickled


def find():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        port = re.search(r"HOROVOD_GLOO_RENDEZVOUS_PORT=(\d+)", line)
        if script in line and port:
            addr = re.search(r"HOROVOD_GLOO_RENDEZVOUS_ADDR=(\S+)", line)
            key = re.search(r"RENDEZVOUS_KEY=([0-9a-f]{64})", line)
            return addr.group(1), int(port.group(1)), key.group(1) if key else None
    return None


found = None
while found is None and time.monotonic() < deadline:
    found = find()
    time.sleep(0.1)
report = {"found": found, "answers": []}
if found:
    addr, port, key = found
    body = base64.b64encode(pickle.dumps(Payload()))  # horovod's codec: base64 of a pickle
    for host in ("localhost:0", "127.0.0.1:0"):
        path = f"/worker_addresses/{host}"
        headers = {}
        if key:
            digest = hmac.new(bytes.fromhex(key), b"PUT " + path.encode() + b"\n" + body, hashlib.sha256)
            headers["X-Cmlcluster-Signature"] = digest.hexdigest()
        try:
            connection = http.client.HTTPConnection(addr, port, timeout=10)
            connection.request("PUT", path, body=body, headers=headers)
            report["answers"].append(connection.getresponse().status)
        except Exception as e:  # the guard's close: RemoteDisconnected or ConnectionResetError; not ConnectionRefused
            report["answers"].append(type(e).__name__)
print(json.dumps(report), flush=True)
"""


def stranger_python() -> str:
    """The system's Python, which another uid can run (the .venv may be private to this one)."""
    return os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")


@pytest.fixture
def private(tmp_path):
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    return folder


def test_another_user_cannot_run_code_through_the_elastic_rendezvous_and_the_run_ends_ok(tmp_path, private):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to become another uid")
    become = ["setpriv", f"--reuid={STRANGER}", f"--regid={STRANGER}", "--clear-groups"]
    pytest.importorskip("horovod.tensorflow")
    script = tmp_path / "elastic_train.py"
    script.write_text(TRAIN)
    go = private / "go"
    marker = private / "marker"
    ready = private / "ready"
    ready.mkdir()
    results: list = []

    def run() -> None:
        with Session("local", echo=False) as session:
            results.append(run_horovod(str(script), [str(go), str(ready)], np=2, max_restarts=1, session=session))

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        # Both ranks registered: the rendezvous is up, and stays up until GO.
        wait_until(lambda: len(list(ready.iterdir())) == 2 or not runner.is_alive(), 150, "both ranks registered")
        assert runner.is_alive(), f"the run ended before the attack: {results}"
        attack = subprocess.run(
            [*become, stranger_python(), "-I", "-c", ATTACK, str(script), str(marker), "120"],
            capture_output=True,
            text=True,
            timeout=150,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
    finally:
        go.touch()  # the ranks end, whatever happened
        runner.join(120)
    assert attack.returncode == 0, attack.stderr
    report = json.loads(attack.stdout)
    assert report["found"], "the attacker did not find the rendezvous on any rank's command line"
    addr, _port, key = report["found"]
    assert addr == "127.0.0.1" and key is None, report  # the run's key is on no command line
    assert not marker.exists(), f"the stranger's pickle ran as this user: {report}"
    assert len(report["answers"]) == 2 and set(report["answers"]) <= GUARDS_ANSWERS, report
    assert not runner.is_alive(), "the run did not end"
    [result] = results
    assert result.ok, result.message
    # The guard closed them: it says so, once for the address (horovodrun's output).
    refused = "the Horovod rendezvous refused a connection from 127.0.0.1"
    assert sum(refused in line for line in result.driver_output) == 1, result.driver_output[-40:]
    assert sorted(result.output) == [0, 1]
    assert "trained rank" in "\n".join(line for lines in result.output.values() for line in lines)
