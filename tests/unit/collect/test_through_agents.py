"""collect= where the backend cannot take a worker's files itself (collect/through_agents.py): the session's
orchestration against fake workers whose agent's side is the real agent_results, on a folder of this test's.
The same on real pods: tests/integration/test_collect.py."""

from __future__ import annotations

import logging
import os

import pytest

from cmlcluster import Session
from cmlcluster.agent import files as agent_files
from cmlcluster.agent.program import call
from cmlcluster.backends.base import Capabilities
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from unit.collect.test_paths import HOSTILE, stream


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
        "cmlcluster.collect.in_worker:pack",
        "cmlcluster.collect.in_worker:chunk",
        "cmlcluster.collect.in_worker:drop",
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
    assert "cmlcluster.collect.in_worker:pack" not in targets(backend)


def test_workers_that_see_the_session_folder_are_never_asked(worker_folder):
    sees_all = Capabilities(own_address=True, session_host=False, python="python3", shared_paths=("/",))
    backend = FakeBackend([FakeWorker(run_time=600)], capabilities=sees_all)
    agent_side(backend)
    with Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session.await_workers([w], wait_for_completion=False, timeout_seconds=10)
        session.stop_workers(w)
    assert targets(backend) == []


def hostile_agent(backend: FakeBackend, data: bytes, claimed: int | None = None) -> None:
    """The fake workers' agents answer pack with a crafted tar file (as an agent whose worker's program
    took it could): the session's end alone decides what of it is written."""

    def answer(engine_id, target, args):
        if target.endswith(":pack"):
            return {"kept": True, "files": 1, "bytes": 1, "size": len(data) if claimed is None else claimed}
        if target.endswith(":chunk"):
            _, offset, size = args
            return data[offset : offset + size]
        return None

    backend.control.responder = answer


def test_a_hostile_agents_stream_writes_only_what_collect_asks_for(worker_folder, tmp_path, caplog):
    session = tmp_path / "session"
    (session / "train.py").write_text("print('train')")
    (tmp_path / "outside").mkdir()
    (session / "outputs").mkdir()
    (session / "outputs" / "data").symlink_to(tmp_path / "outside")  # the user's own link, out of the folder
    members = (*HOSTILE, ("outputs/model.txt", b"trained", 0o644), ("outputs/data/x.py", b"x", 0o644))
    backend = FakeBackend([FakeWorker(run_time=0.1)])
    hostile_agent(backend, stream(*members, ("outputs/train.py", b"x", 0o755)))
    with caplog.at_level(logging.WARNING, logger="cmlcluster"), Session(backend, echo=False) as session_:
        [w] = session_.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session_.await_workers([w], timeout_seconds=10)
    found = sorted(str(p.relative_to(session)) for p in session.rglob("*"))
    assert found == ["outputs", "outputs/data", "outputs/model.txt", "outputs/train.py", "train.py"]
    assert (session / "train.py").read_text() == "print('train')" and list((tmp_path / "outside").iterdir()) == []
    assert os.stat(session / "outputs" / "train.py").st_mode & 0o777 == 0o755  # the worker's, under collect=
    [said] = [r.getMessage() for r in caplog.records if "collect= files" in r.getMessage()]
    assert f"of worker {w['id']}'s collect= files, 2 files" in said
    assert "outputs/data/x.py (outputs/data is a link here, and nothing is written through one)" in said
    assert "it sent 4 files that collect=['outputs'] does not ask for, dropped: .ipython/profile_default" in said


def test_an_agent_that_claims_a_huge_size_is_read_no_further_than_the_caps(worker_folder, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_COLLECT_CAP_MB", "1")
    monkeypatch.setenv("CMLCLUSTER_COLLECT_CAP_FILES", "10")
    backend = FakeBackend([FakeWorker(run_time=0.1)])
    # 20 MiB outside collect=: dropped, but read through unless the read stops at what the caps allow.
    hostile_agent(backend, stream(("x/big", bytes(20 << 20), 0o644)), claimed=1 << 40)
    with Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session.await_workers([w], timeout_seconds=30)
    chunks = [args for _, target, args in backend.control.calls if target.endswith(":chunk")]
    assert len(chunks) == 1  # 4 MiB a call; the caps allow 1 MiB and 10 files' headers


def crafted_agent(backend: FakeBackend, pack, chunk=None) -> None:
    """The fake workers' agents answer pack (and chunk) with whatever these give, as an agent whose
    worker's program took it could."""

    def answer(engine_id, target, args):
        if target.endswith(":pack"):
            return pack
        if target.endswith(":chunk"):
            return chunk(*args[1:]) if chunk else None
        return None

    backend.control.responder = answer


@pytest.mark.parametrize(
    ("pack", "said"),
    [
        (["kept"], "not a report: a list"),
        ({"kept": True, "size": "lots"}, "size"),
        ({"kept": True, "size": None}, "size"),
        ({"kept": True, "size": 9, "links_count": 1, "links": 3}, "links"),
    ],
)
def test_an_agents_report_of_the_wrong_shape_is_read_as_empty_and_said(worker_folder, caplog, pack, said):
    backend = FakeBackend([FakeWorker(run_time=0.1)])
    crafted_agent(backend, pack, lambda offset, size: b"")
    with caplog.at_level(logging.WARNING, logger="cmlcluster"), Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        [ended] = session.await_workers([w], timeout_seconds=10)["workers"]
        assert ended["status"] == "succeeded"
    [shape] = [r.getMessage() for r in caplog.records if "report on its collect= files" in r.getMessage()]
    assert f"worker {w['id']}'s report on its collect= files is not as a host or agent writes it" in shape
    assert said in shape


def test_an_agents_chunk_that_is_not_bytes_ends_the_transfer(worker_folder, tmp_path, caplog):
    backend = FakeBackend([FakeWorker(run_time=0.1)])
    # 10**12 zero bytes, were it made bytes()
    crafted_agent(backend, {"kept": True, "size": 4096}, lambda offset, size: 10**12)
    with caplog.at_level(logging.WARNING, logger="cmlcluster"), Session(backend, echo=False) as session:
        [w] = session.launch_workers(1, cpu=1, memory=1, code="train()", collect="outputs")
        session.await_workers([w], timeout_seconds=10)
    [said] = [r.getMessage() for r in caplog.records if "collect= files" in r.getMessage()]
    assert "the rest (the transfer broke off: its agent sent an int, not bytes)" in said
