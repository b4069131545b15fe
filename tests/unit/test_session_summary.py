"""A session's summary beside its kept logs (cmlcluster/session_summary.py), as the session writes it
(records.Recorder) and `cmlcluster logs` lists it: notebook, outcome, start and end."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from cmlcluster import records, session_summary, worker_logs
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.session import Session

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return tmp_path / "state"


def test_the_notebook_is_the_path_jupyter_server_gives_its_kernels_else_the_program(monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/ann/work/train.ipynb")
    assert session_summary.notebook() == "/home/ann/work/train.ipynb"
    monkeypatch.delenv("JPY_SESSION_NAME")
    for argv0, said in [
        ("", "terminal"),
        ("-c", "python -c"),
        ("/venv/lib/python3.11/site-packages/ipykernel_launcher.py", "a Jupyter kernel"),
        ("train.py", os.path.abspath("train.py")),
    ]:
        monkeypatch.setattr(sys, "argv", [argv0])
        assert session_summary.notebook() == said


def test_the_outcome_counts_statuses_in_a_fixed_order():
    workers = [{"status": s} for s in ("stopped", "succeeded", "failed", "succeeded", "weird")]
    counts = session_summary.outcome(workers)
    assert list(counts.items()) == [("succeeded", 2), ("failed", 1), ("stopped", 1), ("weird", 1)]
    assert session_summary.describe(counts) == "2 succeeded, 1 failed, 1 stopped, 1 weird"
    assert session_summary.describe({}) == "no workers"
    assert [session_summary.duration(s) for s in (4.6, 200, 7500)] == ["5 s", "3 min 20 s", "2 h 05 min"]


def test_a_summary_is_written_whole_and_private_and_only_a_plain_file_is_read(tmp_path):
    session_summary.write(str(tmp_path), {"id": "x", "ended": None})
    path = tmp_path / session_summary.FILE
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert session_summary.read(str(tmp_path)) == {"id": "x", "ended": None}
    assert [p.name for p in tmp_path.iterdir()] == [session_summary.FILE]  # no temporary left
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.json").write_text('{"id": "theirs"}')
    path.unlink()
    path.symlink_to(elsewhere / "secret.json")
    assert session_summary.read(str(tmp_path)) is None  # a link is not followed
    path.unlink()
    path.write_text("[1, 2]")
    assert session_summary.read(str(tmp_path)) is None
    path.write_text(" " * (session_summary.MAX_BYTES + 1) + "{}")
    assert session_summary.read(str(tmp_path)) is None


def test_a_session_keeps_its_summary_while_it_runs_and_says_how_it_ended_at_close(state, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/ann/work/train.ipynb")
    backend = FakeBackend([FakeWorker(run_time=0.1), FakeWorker(run_time=60)])
    with Session(backend, echo=False) as s:
        quick, slow = s.launch_workers(2, cpu=0.5, memory=0.5, code="the fake's program")
        s.await_workers([quick], wait_for_completion=True, timeout_seconds=30)
        s.drain(5)
        running = session_summary.read(s.log_folder)
        assert running is not None
        assert running["notebook"] == "/home/ann/work/train.ipynb" and running["ended"] is None
        assert running["outcome"] == {"succeeded": 1, "running": 1}
        [record] = records.records()
        assert record["notebook"] == "/home/ann/work/train.ipynb"
        folder = s.log_folder
    closed = session_summary.read(folder)
    assert closed is not None
    assert closed["outcome"] == {"succeeded": 1, "stopped": 1}
    assert closed["ended"] >= closed["started"] > 0
    assert {w["id"]: w["status"] for w in closed["workers"]} == {quick["id"]: "succeeded", slow["id"]: "stopped"}


def kept_session(root, session_id: str, summary: dict | None, workers: int = 1) -> None:
    folder = root / session_id
    folder.mkdir(parents=True, mode=0o700)
    for n in range(workers):
        (folder / f"{session_id}-{n}.log").write_text("line\n")
    if summary is not None:
        (folder / session_summary.FILE).write_text(json.dumps(summary))


def test_cmlcluster_logs_lists_sessions_by_notebook_outcome_and_duration(state, capsys, monkeypatch):
    root = worker_logs.folder()
    home = os.path.expanduser("~")
    started = 1_700_000_000.0
    kept_session(
        state / "logs",
        "1" * 16,
        {
            "notebook": f"{home}/work/train.ipynb",
            "started": started,
            "ended": started + 200,
            "outcome": {"succeeded": 2},
        },
        workers=2,
    )
    kept_session(
        state / "logs",
        "2" * 16,
        {"notebook": "/srv/job.py", "started": started, "ended": None, "outcome": {"running": 1}},
    )
    kept_session(state / "logs", "3" * 16, None)
    died = state / "logs" / ("2" * 16)
    for path in [*died.iterdir(), died]:  # its last write, the latest it was seen alive
        os.utime(path, (started + 65, started + 65))
    assert worker_logs.show(None) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert out.splitlines()[0].startswith(f"worker logs in {root} ")
    assert re.match(r"session +notebook +started +duration +outcome +workers +size", out.splitlines()[1])
    assert re.search(r"~/work/train\.ipynb +\S+ \S+ +3 min 20 s +2 succeeded +2 ", lines["1" * 16])
    assert re.search(r"/srv/job\.py +\S+ \S+ +~1 min 05 s +died \(1 running\) +1 ", lines["2" * 16])
    assert "unknown (an older cmlcluster's session)" in lines["3" * 16]
