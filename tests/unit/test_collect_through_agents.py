"""collect= where the backend cannot take a worker's files itself (collect_through_agents.py): the session's
orchestration against fake workers whose agent's side is the real agent_results, on a folder of this test's.
The same on real pods: tests/integration/test_collect.py."""

from __future__ import annotations

import logging

import pytest

from cmlcluster import Session, agent_files
from cmlcluster.agent_program import call
from cmlcluster.backends.base import Capabilities
from cmlcluster.backends.fake import FakeBackend, FakeWorker


@pytest.fixture
def worker_folder(tmp_path, monkeypatch):
    """The fake worker's own working folder, holding outputs/model.txt; the session runs in another."""
    folder = tmp_path / "worker"
    (folder / "outputs").mkdir(parents=True)
    (folder / "outputs" / "model.txt").write_text("trained")
    (folder / "stray.txt").write_text("not collected")
    monkeypatch.setattr(agent_files, "own_folder", str(folder))
    monkeypatch.setattr(agent_files, "collected", ("outputs",))
    monkeypatch.setattr(agent_files, "started", 0.0)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "worker-tmp"))
    (tmp_path / "worker-tmp").mkdir()
    session_folder = tmp_path / "session"
    session_folder.mkdir()
    monkeypatch.chdir(session_folder)
    return folder


def agent_side(backend: FakeBackend) -> None:
    """The fake workers answer the session's calls as a real agent does, in this process."""
    backend.control.responder = lambda engine_id, target, args: call(target, *args)


def targets(backend: FakeBackend) -> list[str]:
    return [target for _, target, _ in backend.control.calls]


def test_a_stop_interrupts_the_program_then_takes_its_files_then_stops_the_worker(worker_folder, tmp_path):
    backend = FakeBackend([FakeWorker(run_time=600)])
    agent_side(backend)
    with Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session.await_workers([w], wait_for_completion=False, timeout_seconds=10)
        [stopped] = session.stop_workers(w)
        assert stopped["status"] == "stopped"
        assert (tmp_path / "session" / "outputs" / "model.txt").read_text() == "trained"  # before the stop returned
    assert targets(backend)[:4] == [
        "interrupt",
        "cmlcluster.agent_results:pack",
        "cmlcluster.agent_results:chunk",
        "cmlcluster.agent_results:drop",
    ]
    assert not (tmp_path / "session" / "stray.txt").exists()
    assert list((tmp_path / "worker-tmp").iterdir()) == []  # nothing of it left on the worker's side


def test_a_program_that_fails_has_its_files_home_before_its_end_is_reported(worker_folder, tmp_path):
    backend = FakeBackend([FakeWorker(run_time=0.1, exit_code=3)])
    agent_side(backend)
    with Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        [failed] = session.await_workers([w], timeout_seconds=10)["failures"]
        assert failed["exit_code"] == 3
        assert (tmp_path / "session" / "outputs" / "model.txt").read_text() == "trained"
    assert "interrupt" not in targets(backend)


def test_a_worker_killed_outright_is_said_to_have_taken_its_files_with_it(worker_folder, caplog):
    backend = FakeBackend([FakeWorker(run_time=600, dies_after=0.3)])
    agent_side(backend)
    with caplog.at_level(logging.WARNING, logger="cmlcluster"), Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session.await_workers([w], timeout_seconds=10)
    [said] = [r.getMessage() for r in caplog.records if "collect= files did not come home" in r.getMessage()]
    assert f"worker {w['id']}'s collect= files did not come home: it ended before its agent could send them" in said
    assert "the fake backend" in said and "shared volume" in said
    assert "cmlcluster.agent_results:pack" not in targets(backend)


def test_workers_that_see_the_session_folder_are_never_asked(worker_folder):
    sees_all = Capabilities(own_address=True, session_host=False, python="python3", shared_paths=("/",))
    backend = FakeBackend([FakeWorker(run_time=600)], capabilities=sees_all)
    agent_side(backend)
    with Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session.await_workers([w], wait_for_completion=False, timeout_seconds=10)
        session.stop_workers(w)
    assert targets(backend) == []
