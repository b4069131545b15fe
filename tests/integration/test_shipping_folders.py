"""A working folder as users have them, shipped to Docker containers that do not mount it."""

from __future__ import annotations

import textwrap

import pytest
from conftest import DOCKER_TEST_IMAGE

from cmlcluster import Session
from cmlcluster.backends.docker import DockerBackend

pytestmark = pytest.mark.integration


def test_a_real_folder_ships_with_its_inside_links_and_without_secrets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("x,y\n1,2\n")
    (tmp_path / "latest.csv").symlink_to("data/train.csv")  # inside: travels as a link
    (tmp_path / "system").symlink_to("/etc")  # outside: stays behind, with a warning
    (tmp_path / ".env").write_text("TOKEN=secret\n")  # left out by default
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "old.ckpt").write_text("weights")
    (tmp_path / ".cmlclusterignore").write_text("checkpoints/\n")
    (tmp_path / "job.py").write_text(
        textwrap.dedent(
            """
            import os
            print(sorted(os.listdir(".")))
            print(os.readlink("latest.csv"), open("latest.csv").read().splitlines()[1])
            """
        )
    )
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, mount_cwd=False)
    with Session(backend, echo=False) as s:
        assert not backend.capabilities().sees(str(tmp_path))  # the real case: the folder travels
        with pytest.warns(UserWarning, match="system -> /etc"):
            [w] = s.launch_workers(1, cpu=0.5, memory=0.5, script="job.py", ship_working_folder=True)
        assert s.await_workers([w], timeout_seconds=90)["failures"] == []
        listing, link = s.output(w).splitlines()
    assert listing == str([".cmlclusterignore", "data", "job.py", "latest.csv"])
    assert link == "data/train.csv 1,2"
