"""A worker's log file stays capped however much its process writes to its descriptors (cmlcluster.logfile),
its head and last lines kept, and a dying worker's last words are in it when its end is reported. The
caps are made small here (the same code as 1 MiB and 8 MiB), so that a few MB printed pass them."""

from __future__ import annotations

import logging
import os
import textwrap

import pytest

from cmlcluster import Session, cgroups, logfile

pytestmark = pytest.mark.integration

HEAD, TAIL = 64 * 1024, 256 * 1024
LINES = 20_000  # of 100 bytes: 2 MB, six times the caps
MARKER = b"bytes of output dropped here"


@pytest.fixture
def small_logs(monkeypatch):
    # The session's process writes every worker's log (its copy threads), so patching here is enough.
    monkeypatch.setattr(logfile, "HEAD_BYTES", HEAD)
    monkeypatch.setattr(logfile, "TAIL_BYTES", TAIL)


def on_disk(session, worker) -> bytes:
    with open(os.path.join(session.log_folder, f"{worker['id']}.log"), "rb") as f:
        return f.read()


# Written to the process's own descriptor by a child process, as `subprocess.run(["python", "train.py"])`
# in a program does: this reaches the worker's log (ipykernel echoes fd 1 there), not only the session.
FLOOD = """
    import subprocess, sys
    PRINTER = "print('the first line'); [print(f'line {i:07d}', 'x' * 86) for i in range(LINES)]"
    subprocess.run([sys.executable, "-c", PRINTER + "; print('the last line')"], check=True)
"""


@pytest.mark.parametrize("backend", ["local", "ssh"], indirect=True)
def test_a_worker_printing_far_past_the_cap_keeps_its_head_and_last_lines_and_no_more(small_logs, session):
    code = textwrap.dedent(FLOOD).replace("LINES", str(LINES))
    [w] = session.launch_workers(1, cpu=0.5, memory=0.5, code=code)
    done = session.await_workers([w], timeout_seconds=180)
    assert [x["status"] for x in done["workers"]] == ["succeeded"], done["failures"]
    log = on_disk(session, w)
    assert len(log) <= HEAD + TAIL + 300, f"the log holds {len(log):,} bytes"
    assert log.count(MARKER) == 1
    head, tail = log.split(MARKER)
    assert b"the first line\n" in head
    assert b"line 0019999 " + b"x" * 86 + b"\nthe last line\n" in tail
    assert "the last line" in session.worker_log(w)


# A worker that dies before it reaches the controller, after much output: only its log knows why.
DYING = """
    import os, sys, traceback
    os.write(1, b"the first line\\n")
    for i in range(LINES):
        os.write(1, b"line %07d %s\\n" % (i, b"x" * 86))
    try:
        raise RuntimeError("the last words of a dying worker")
    except RuntimeError:
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(3)
"""


@pytest.mark.parametrize("backend", ["local", "ssh"], indirect=True)
def test_a_worker_dying_after_much_output_is_reported_with_its_last_traceback_line(
    small_logs, session, worker_startup_hook
):
    env = worker_startup_hook(session.backend, textwrap.dedent(DYING).replace("LINES", str(LINES)))
    [w] = session.launch_workers(1, cpu=0.5, memory=0.5, env=env)
    [failure] = session.await_workers([w], timeout_seconds=180)["failures"]
    assert failure["exit_code"] == 3, failure
    assert failure["message"].splitlines()[-1] == "RuntimeError: the last words of a dying worker", failure["message"]
    log = on_disk(session, w)
    assert len(log) <= HEAD + TAIL + 300, f"the log holds {len(log):,} bytes"
    assert log.startswith(b"the first line\n") and log.count(MARKER) == 1
    assert log.rstrip().endswith(b"RuntimeError: the last words of a dying worker")


def test_missing_limits_on_local_workers_are_said_once_a_session(monkeypatch, caplog):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", "/dev/null/cgroup")  # nothing can be made below a file
    with caplog.at_level(logging.DEBUG, logger="cmlcluster.resources"):
        for _ in range(2):
            with Session("local", echo=False) as s:
                workers = s.launch_workers(2, cpu=0.5, memory=0.5, code="print('ok')")
                assert s.await_workers(workers, timeout_seconds=60)["failures"] == []
    said = [r for r in caplog.records if r.name == "cmlcluster.resources"]
    assert [r.levelno for r in said] == [logging.WARNING] * 2, [r.getMessage() for r in said]
    assert "CPU/memory limits are not applied to local workers" in said[0].getMessage()


def test_a_worker_that_printed_nothing_has_nothing_of_ipyparallels_own_in_its_log(tmp_path, monkeypatch):
    # ipyparallel 9's engine prints its log's handlers as it starts (agent_engine.redirect_output says why not).
    monkeypatch.chdir(tmp_path)
    with Session("local", echo=False) as session:
        [w] = session.launch_workers(1, cpu=0.5, memory=0.5, code="print('only this')")
        assert session.await_workers([w], timeout_seconds=60)["failures"] == []
        log = on_disk(session, w).decode()
    assert "only this" in log and "StreamHandler" not in log, log
