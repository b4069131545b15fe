"""What a program leaves in a worker's own working folder, removed with the worker (SSH hosts, where
workers do not see the session's folder), is named before it goes (cmlcluster/leftovers.py)."""

from __future__ import annotations

import logging
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WRITES = """
import os
os.makedirs("checkpoints")
open("checkpoints/x", "w").write("x" * 1000)
open("model.txt", "w").write("m")
"""


@pytest.mark.parametrize("backend", ["ssh"], indirect=True)
def test_files_a_program_wrote_in_its_own_folder_are_named_once_when_it_ends_but_not_the_shipped_ones(
    session, tmp_path, monkeypatch, caplog
):
    monkeypatch.chdir(tmp_path)  # the working folder travels into the worker's own, with train.py
    (tmp_path / "train.py").write_text(WRITES)
    with caplog.at_level(logging.WARNING, logger="cmlcluster.leftovers"):
        [w] = session.launch_workers(1, cpu=0.5, memory=0.5, script="train.py", ship_working_folder=True)
        assert session.await_workers([w], timeout_seconds=90)["failures"] == []
        session.stop_workers(w)  # stopped again, as a session's close does: not said twice
    [said] = [r.getMessage() for r in caplog.records if r.name == "cmlcluster.leftovers"]
    assert f"worker {w['id']}'s working folder /" in said
    assert "holds checkpoints/, model.txt (2 files, 1.0 kB)" in said and "removed with it" in said


@pytest.mark.parametrize("backend", ["ssh"], indirect=True)
def test_a_program_stopped_midway_names_what_it_leaves_in_its_output(session, caplog):
    code = WRITES + "print('saved', flush=True)\nimport time\ntime.sleep(600)"
    with caplog.at_level(logging.WARNING, logger="cmlcluster.leftovers"):
        [w] = session.launch_workers(1, cpu=0.5, memory=0.5, code=code)
        assert session.await_workers([w], wait_for_completion=False, timeout_seconds=90)["failures"] == []
        for _ in range(300):
            if "saved" in session.output(w):
                break
            time.sleep(0.1)
        [stopped] = session.stop_workers(w)
    assert stopped["status"] == "stopped"
    said = [line for line in session.output(w).splitlines() if line.startswith("cmlcluster: ")]
    assert len(said) == 1 and "holds checkpoints/, model.txt (2 files, 1.0 kB)" in said[0], session.output(w)
    assert not [r for r in caplog.records if r.name == "cmlcluster.leftovers"]  # the busy worker was not asked
