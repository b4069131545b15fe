"""A worker's log outlives its session (cmlcluster/worker_logs.py): after the session's process is
SIGKILLed (a kernel that died), its folder gone with its controller's lifeline, `cmlcluster logs` still
prints what the worker's program printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cmlcluster import origin, records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SESSION_SCRIPT = textwrap.dedent("""
    import json, time
    from cmlcluster import Session
    s = Session("local", echo=False)
    code = "print('the worker started'); print('its last line', flush=True); import time; time.sleep(600)"
    [w] = s.launch_workers(1, cpu=0.5, memory=0.5, code=code)
    deadline = time.monotonic() + 60
    while "its last line" not in s.worker_log(w) and time.monotonic() < deadline:
        time.sleep(0.1)
    s.drain(5)  # its record names the worker's pid, for the cleanup
    print(json.dumps({"session": s.id, "worker": w["id"]}), flush=True)
    time.sleep(3600)
""")


def test_a_killed_sessions_worker_log_is_printed_by_cmlcluster_logs(tmp_path, monkeypatch):
    # Its records and logs in a state folder of this test's: the cleanup below touches only its session.
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-c", SESSION_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ids = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    # Its controller's lifeline removes the session's folder, where the logs were.
    deadline = time.monotonic() + 30
    while (record := records.records()[0])["state"] != origin.GONE and time.monotonic() < deadline:
        time.sleep(0.2)
    while os.path.exists(record["session_dir"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(record["session_dir"])
    # Nothing left for `cmlcluster cleanup` to end: the worker ended with its session (its lifeline).
    assert records.clean(record) == []

    def logs(*args: str) -> str:
        shown = subprocess.run(
            [sys.executable, "-m", "cmlcluster", "logs", *args], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        return shown.stdout

    assert logs(ids["session"], ids["worker"], "--tail", "1") == "its last line\n"
    assert "the worker started\nits last line\n" in logs(ids["session"][:8])
