"""A working folder as users have them, shipped to Docker containers that do not mount it."""

from __future__ import annotations

import logging
import textwrap

import pytest
from harness.fixtures import DOCKER_TEST_IMAGE

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend

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


# A CML project folder is the user's HOME: credential stores lie in it beside the code.
HOME_SECRETS = [
    ".aws/credentials", ".kube/config", ".netrc", ".git-credentials", ".pypirc", ".docker/config.json",
    ".config/gcloud/application_default_credentials.json", ".ssh/config", ".ssh/known_hosts",
    ".local/share/jupyter/runtime/jpserver-1234.json",
    ".local/share/jupyter/runtime/kernel-6c1f9c5e-1b7d-4a2f-9f1e-2d3c4b5a6978.json", "certs/server.key",
    "certs/client.p12", "keys/id_rsa", ".bash_history", ".python_history", ".env",
]  # fmt: skip
HOME_CODE = [
    "job.py",
    "src/id_utils.py",
    "data/id_to_label.json",
    "keys/id_rsa.pub",
    ".ipython/profile_default/startup/00.py",
]


def test_a_home_folder_ships_to_a_container_without_its_credentials(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    for name in [*HOME_SECRETS, *HOME_CODE]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("secret\n" if name in HOME_SECRETS else "x = 1\n")
    (tmp_path / "job.py").write_text(
        textwrap.dedent(
            """
            import os
            for folder, _, files in os.walk("."):
                for name in files:
                    print(os.path.relpath(os.path.join(folder, name)))
            """
        )
    )
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, mount_cwd=False)
    with caplog.at_level(logging.WARNING, logger="cmlcluster.shipping"), Session(backend, echo=False) as s:
        assert not backend.capabilities().sees(str(tmp_path))
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5, script="job.py", ship_working_folder=True)
        assert s.await_workers([w], timeout_seconds=90)["failures"] == []
        found = sorted(s.output(w).split())
    assert found == sorted(HOME_CODE)  # what the worker's folder holds: the code, and none of the secrets
    [notice] = [r.getMessage() for r in caplog.records if r.name == "cmlcluster.shipping"]
    assert notice.startswith("cmlcluster: not shipped to workers (may hold credentials): .aws/, .bash_history, ")
    assert " and 10 more; in " in notice and "a !pattern ships one" in notice
