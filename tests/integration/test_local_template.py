"""Local workers forked from a template agent (agent/template.py): they must be what a
worker started on its own is, and every way the template can fail must leave workers that run."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from harness.processes import wait_until

from cmlcluster import Session
from cmlcluster.backends.local import LocalBackend

pytestmark = pytest.mark.integration

# What a worker is, as its program sees it.
DESCRIBE = (
    "import json, os, sys, tempfile; print('worker:' + json.dumps({"
    "'cwd': os.getcwd(), 'id': os.environ['CDSW_ENGINE_ID'], 'tmpdir': os.environ['TMPDIR'], "
    "'gettempdir': tempfile.gettempdir(), 'path0': sys.path[0], 'leader': os.getpgrp() == os.getpid(), "
    "'sid': os.getsid(0) == os.getpid(), 'gpus': os.environ['CUDA_VISIBLE_DEVICES'], "
    "'connection': [k for k in os.environ if k.startswith('CMLCLUSTER_CONNECTION')], 'argv': sys.argv, "
    "'parent': os.getppid(), 'pid': os.getpid()}))"
)


def described(session: Session, worker_id: str) -> dict:
    line = next(x for x in session.output(worker_id).splitlines() if x.startswith("worker:"))
    return json.loads(line.removeprefix("worker:"))


def templates() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children():
        try:
            if child.cmdline()[-2:] == ["cmlcluster.agent", "--template"]:
                found.append(child)
        except psutil.Error:  # ended (a zombie until its reaper gets to it)
            continue
    return found


def run_described(fork: bool) -> list[dict]:
    with Session(LocalBackend(fork=fork, gpus=["0", "1"]), echo=False) as s:
        workers = s.launch_workers(2, cpu=1, memory=1, nvidia_gpu=1, code=DESCRIBE)
        result = s.await_workers(workers, timeout_seconds=60)
        assert result["failures"] == []
        found = [described(s, w["id"]) for w in workers]
        forked_from = {p.pid for p in templates()}
    for worker, record in zip(workers, found, strict=True):
        assert record["id"] == worker["id"]
        record["tmpdir_is_own"] = record["tmpdir"].endswith(f"/workers/{worker['id']}.tmp")
        record["parent_is_template"] = record.pop("parent") in forked_from
        del record["id"], record["tmpdir"], record["gettempdir"], record["pid"]
    return found


def test_forked_workers_are_what_workers_started_on_their_own_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    forked, started = run_described(True), run_described(False)
    assert [w.pop("parent_is_template") for w in forked] == [True, True]
    assert [w.pop("parent_is_template") for w in started] == [False, False]
    assert forked == started
    assert forked[0]["cwd"] == str(tmp_path) and forked[0]["path0"] == ""
    assert sorted(w["gpus"] for w in forked) == ["0", "1"]
    assert all(w["leader"] and w["sid"] and w["tmpdir_is_own"] and w["connection"] == [] for w in forked)
    assert templates() == []  # closed with the session


def test_forked_workers_get_their_own_temp_folder_and_exit_codes(local_session_forked):
    s = local_session_forked
    ok, failing, killed = (
        s.launch_workers(1, cpu=1, memory=1, code=DESCRIBE),
        s.launch_workers(1, cpu=1, memory=1, code="import sys; sys.exit(3)"),
        s.launch_workers(1, cpu=1, memory=1, code="import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
    )
    s.await_workers(ok + failing + killed, timeout_seconds=60)
    [template] = templates()  # one environment, one template
    record = described(s, ok[0]["id"])
    assert record["gettempdir"] == record["tmpdir"]  # not the template's: tempfile reads TMPDIR again
    assert record["parent"] == template.pid
    codes = {w["id"]: w["exit_code"] for w in s.list_workers()}
    assert [codes[failing[0]["id"]], codes[killed[0]["id"]]] == [3, -signal.SIGKILL]


def test_a_launch_that_changes_how_python_starts_gets_workers_started_on_their_own(local_session_forked, tmp_path):
    # A sitecustomize on the launch's PYTHONPATH is each worker's start-up code: it must run in each.
    (tmp_path / "sitecustomize.py").write_text("import os; print('hook ran in', os.getpid(), flush=True)\n")
    s = local_session_forked
    workers = s.launch_workers(2, cpu=1, memory=1, code=DESCRIBE, env={"PYTHONPATH": str(tmp_path)})
    s.await_workers(workers, timeout_seconds=60)
    for w in workers:
        record = described(s, w["id"])
        assert f"hook ran in {record['pid']}" in s.worker_log(w)  # its log
        assert record["parent"] == os.getpid()
    assert templates() == []


def test_a_killed_template_ends_its_workers_and_later_workers_start_on_their_own(local_session_forked):
    s = local_session_forked
    workers = s.launch_workers(2, cpu=1, memory=1, code="import time; time.sleep(600)")
    s.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
    [template] = templates()
    pids = [p.pid for p in template.children()]
    assert len(pids) == 2
    template.kill()
    # Nothing can read their exit codes any more, and nothing supervises them: they end, as killed.
    wait_until(lambda: all(w["status"] == "failed" for w in s.list_workers()), 30, "the workers to end")
    assert [w["exit_code"] for w in s.list_workers()] == [-signal.SIGKILL] * 2
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    later = s.launch_workers(1, cpu=1, memory=1, code=DESCRIBE)
    assert s.await_workers(later, timeout_seconds=60)["failures"] == []
    assert described(s, later[0]["id"])["parent"] == os.getpid()


def test_a_template_whose_start_up_started_threads_does_not_fork(tmp_path, monkeypatch):
    # The session's own environment runs a hook that starts a thread (as APM agents' sitecustomize
    # do): forking that process would copy one thread of two, so its workers start on their own.
    (tmp_path / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with Session(LocalBackend(), echo=False) as s:
        workers = s.launch_workers(2, cpu=1, memory=1, code=DESCRIBE)
        assert s.await_workers(workers, timeout_seconds=60)["failures"] == []
        assert [described(s, w["id"])["parent"] for w in workers] == [os.getpid()] * 2
        log = os.path.join(s.session_dir, "workers", "template-0.log")
        deadline = time.monotonic() + 10
        while templates() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert templates() == [], f"the template lives on: {open(log).read()}"


@pytest.fixture
def local_session_forked():
    with Session(LocalBackend(), echo=False) as s:
        yield s
