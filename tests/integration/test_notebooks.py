"""The example notebooks, executed top to bottom on a real Jupyter kernel."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import nbformat
import pytest
from harness.kernels import kernel_manager
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


WIDGET = "application/vnd.jupyter.widget-view+json"


def execute(name: str) -> list[str]:
    """Run notebooks/<name> in a fresh kernel; return each code cell's text output.

    The kernel's working folder is the notebook's own, as JupyterLab starts it (not the repository's
    root, where a path written for a terminal there would work and hide that it fails as opened).

    A cell that displayed the session's widget has "<widget>" in its text (what the widget shows is
    checked through trait values in test_ui.py, and in a browser in tests/browser).
    """
    path = ROOT / "notebooks" / name
    notebook = nbformat.read(path, as_version=4)
    # nbclient's loop takes SIGINT and asyncio gives it back as Python's default handler, whatever was
    # there: an xdist worker starts with SIGINT ignored, and later tests of this process would not.
    found = signal.getsignal(signal.SIGINT)
    with kernel_manager() as km:
        client = NotebookClient(notebook, km=km, timeout=600, resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute(cleanup_kc=True)  # shuts the kernel down, as for a kernel of its own
        finally:
            signal.signal(signal.SIGINT, found)
    texts = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            texts.append(
                "".join(
                    "<widget>\n"
                    if WIDGET in o.get("data", {})
                    else o.get("text", "") or o.get("data", {}).get("text/plain", "")
                    for o in cell.get("outputs", [])
                )
            )
    return texts


# tensorflow_parameter_server.ipynb runs in JupyterLab (tests/browser/test_widgets_in_browser.py), which
# checks what its cells print as well as its loss curve: not a second time here.


# On local: %horovod across containers is test_horovod's (and test_horovod_elastic's, as root); this is the
# notebook, run by a real kernel.
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.matrix)])
def test_horovod_notebook_runs_allreduce_and_cleans_up(backend, monkeypatch):
    from harness.fixtures import DOCKER_TEST_IMAGE

    monkeypatch.setenv("CMLCLUSTER_BACKEND", backend)  # the kernel inherits it
    monkeypatch.setenv("CMLCLUSTER_DOCKER_IMAGE", DOCKER_TEST_IMAGE)
    monkeypatch.setenv("CMLCLUSTER_DOCKER_HOST_PYTHON", "1")
    _, training, summary, left = execute("horovod.ipynb")
    assert training == "<widget>\n", training  # the ranks' output and progress are in the widget
    assert re.search(r"^rank 0 of size 2 on host \S+: weights checksum", summary, re.M), summary
    assert re.search(r"^rank 1 of size 2 on host \S+: weights checksum", summary, re.M), summary
    checksums = re.findall(r"weights checksum (\S+)", summary)
    assert len(checksums) == 2 and checksums[0] == checksums[1], summary
    assert "exit code: 0" in summary
    hosts = re.search(r"hosts: (.*)", summary).group(1)
    assert hosts == "[('localhost', 2)]" if backend == "local" else hosts.count(", 1)") == 2
    assert left.strip() in ("no workers", "['stopped']")


def test_worker_api_notebook_runs_cml_calls_unchanged():
    _, launch, idle, pids, stopped = execute("worker_api.ipynb")
    assert launch == "<widget>\n['succeeded', 'succeeded'] []\n", launch  # the widget, once, then the result
    assert idle == "<widget>\nrunning: 2 addresses known: True\n"  # each launching cell shows it
    assert pids == "worker processes: 2\n"
    assert stopped == "['stopped', 'succeeded']\n"


def test_hyperparameter_search_notebook_spreads_configurations_over_workers():
    ready, trained, table, plot, stopped = execute("hyperparameter_search.ipynb")
    assert ready == "<widget>\n3 workers ready\n"
    assert re.fullmatch(r"12 configurations trained on [23] workers\n", trained), trained
    best = re.search(r"best: learning_rate=([\d.]+) epochs=(\d+) loss=([\d.]+)", table)
    assert best and float(best.group(1)) >= 0.2 and best.group(2) == "400" and float(best.group(3)) < 0.01, table
    assert "learning_rate" in table and "worker" in table  # the DataFrame
    assert plot == "<widget>\n"  # the bqplot figure
    assert stopped == "['stopped']\n"


# On local: DDP across containers is test_torch's; this is the notebook, run by a real kernel.
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.matrix)])
def test_pytorch_notebook_trains_ddp_on_four_ranks_and_cleans_up(backend, monkeypatch):
    from harness.fixtures import DOCKER_TEST_IMAGE

    monkeypatch.setenv("CMLCLUSTER_BACKEND", backend)
    monkeypatch.setenv("CMLCLUSTER_DOCKER_IMAGE", DOCKER_TEST_IMAGE)
    monkeypatch.setenv("CMLCLUSTER_DOCKER_HOST_PYTHON", "1")
    _, training, summary, function, left = execute("pytorch_ddp.ipynb")
    assert training == "<widget>\n"  # the ranks' output and the loss curve are in the widget
    digests = re.findall(r"^rank (\d) of 4 on \S+ \(cpu, gloo\): parameters (\w+)$", summary, re.M)
    assert [rank for rank, _ in digests] == ["0", "1", "2", "3"], summary
    assert len({digest for _, digest in digests}) == 1, summary
    first, last = map(float, re.search(r"epoch 1 loss ([\d.]+) -> epoch 4 loss ([\d.]+)", summary).groups())
    assert last < first / 5, summary
    assert "exit code: 0" in summary
    hosts = re.search(r"nodes: \['([\d.]+)', '([\d.]+)'\]", summary).groups()
    assert (hosts[0] == hosts[1] == "127.0.0.1") if backend == "local" else hosts[0] != hosts[1]
    assert function == "<widget>\nsum of ranks: 6.0\n"  # a launching cell shows the widget
    assert left.strip() == "['stopped']"
