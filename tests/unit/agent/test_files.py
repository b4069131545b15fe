"""What a worker's own working folder holds besides the files shipped into it (agent_files.leftovers),
in a crafted folder: the program's files are named, biggest first, the shipped ones only once changed."""

from __future__ import annotations

import pytest

from cmlcluster import shipping
from cmlcluster.agent import files as agent_files


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(agent_files, "own_folder", str(tmp_path))
    monkeypatch.setattr(agent_files, "_shipped", {})
    monkeypatch.setattr(agent_files, "_files_folder", None)
    return tmp_path


def test_the_programs_files_are_named_biggest_first_and_the_shipped_ones_only_once_changed(work, tmp_path_factory):
    source = tmp_path_factory.mktemp("session")
    (source / "train.py").write_text("print('train')\n")
    (source / "config.yaml").write_text("lr: 0.1\n")
    agent_files.unpack_files(shipping.pack({}, str(source)), in_cwd=True)
    assert agent_files.leftovers() is None  # only what was shipped
    (work / "checkpoints").mkdir()
    (work / "checkpoints" / "epoch-1").write_bytes(b"x" * 5000)
    (work / "model.keras").write_bytes(b"m" * 200)
    (work / "config.yaml").write_text("lr: 0.01, changed by the program\n")
    (work / "__pycache__").mkdir()
    (work / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"c" * 9000)
    found = agent_files.leftovers()
    assert found == {
        "folder": str(work), "names": ["checkpoints/", "model.keras", "config.yaml"], "files": 3,
        "bytes": 5000 + 200 + 33, "more": False,
    }  # fmt: skip
    said = agent_files.notice("w-3", found)
    assert "worker w-3's working folder" in said
    assert "holds checkpoints/, model.keras, config.yaml (3 files, 5.2 kB)" in said


def test_a_shared_working_folder_is_never_reported(work, monkeypatch):
    (work / "results.csv").write_text("1,2\n")
    monkeypatch.setattr(agent_files, "own_folder", "")
    assert agent_files.leftovers() is None
