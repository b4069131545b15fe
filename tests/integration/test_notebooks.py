"""The example notebooks, executed top to bottom on a real Jupyter kernel."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def execute(name: str) -> list[str]:
    """Run notebooks/<name> in a fresh kernel from the repository root; return each code cell's text output."""
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    texts = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            texts.append(
                "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []))
            )
    return texts


def test_parameter_server_notebook_trains_and_stops():
    _, spec, training, weights, stopped = execute("tensorflow_parameter_server.ipynb")
    assert re.search(r"^ps \['127\.0\.0\.1:\d+'\]$", spec, re.M), spec
    assert re.search(r"^worker \['127\.0\.0\.1:\d+', '127\.0\.0\.1:\d+'\]$", spec, re.M), spec
    first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+)", training).groups())
    assert last < first / 4, training
    assert "variables on: ['/job:ps/replica:0/task:0/device:CPU:0']" in training
    learned = [float(v) for v in re.search(r"\[([^\]]+)\]", weights).group(1).split()]
    assert learned == pytest.approx([1.0, -2.0, 3.0, 0.5], abs=0.5)
    assert stopped.strip() == "['stopped', 'stopped', 'stopped']"


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_horovod_notebook_runs_allreduce_and_cleans_up(backend, monkeypatch):
    from conftest import DOCKER_TEST_IMAGE

    monkeypatch.setenv("CMLCLUSTER_BACKEND", backend)  # the kernel inherits it
    monkeypatch.setenv("CMLCLUSTER_DOCKER_IMAGE", DOCKER_TEST_IMAGE)
    monkeypatch.setenv("CMLCLUSTER_DOCKER_HOST_PYTHON", "1")
    _, training, summary, left = execute("horovod.ipynb")
    assert "[rank 0] rank 0 of size 2" in training and "[rank 1] rank 1 of size 2" in training
    checksums = re.findall(r"rank \d: weights checksum (\S+)", summary)
    assert len(checksums) == 2 and checksums[0] == checksums[1], summary
    assert "exit code: 0" in summary
    hosts = re.search(r"hosts: (.*)", summary).group(1)
    assert hosts == "[('localhost', 2)]" if backend == "local" else hosts.count(", 1)") == 2
    assert left.strip() in ("no workers", "['stopped']")
