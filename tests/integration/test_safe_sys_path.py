"""The helper processes a session starts (`python -m` ...: its controller, TensorBoard, an elastic PyTorch
run's store, horovodrun through cmlcluster's driver, the Docker reaper) never import from the notebook's
working folder (cmlcluster._proc.python_module): a json.py, zmq.py or threading.py there, which `python -m`
would import in place of the real one, runs in none of them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import textwrap

import pytest

from cmlcluster import Session
from cmlcluster._proc import python_module
from cmlcluster.horovod.run import _horovodrun
from cmlcluster.tensorboard_server import TensorBoard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Names each helper imports as it starts (runpy and argparse: what a -c or -m start would import next).
HOSTILE = ("json", "zmq", "threading", "runpy", "argparse", "socket", "selectors", "datetime")


@pytest.fixture
def notebook_folder(tmp_path, monkeypatch):
    """A working folder holding modules that leave a mark, naming the process, when imported; the marks folder."""
    folder, marks = tmp_path / "notebook", tmp_path / "marks"
    folder.mkdir()
    marks.mkdir()
    for name in HOSTILE:
        (folder / f"{name}.py").write_text(
            textwrap.dedent(f"""
                import os, sys
                with open(os.path.join({str(marks)!r}, "{name}-" + str(os.getpid())), "w") as f:
                    f.write(" ".join(sys.argv))
                raise ImportError("the notebook folder's {name}.py ran")
            """)
        )
    monkeypatch.chdir(folder)
    return marks


def marks_left(marks) -> dict[str, str]:
    return {name: (marks / name).read_text() for name in os.listdir(marks)}


def test_no_helper_imports_from_the_notebooks_folder(notebook_folder, tmp_path):
    with Session("local", echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5, code="print('ran')")  # the controller started
        s.await_workers([w], timeout_seconds=60)
        with TensorBoard.start(str(tmp_path / "logs"), session_dir=s.session_dir) as board:
            assert board.poll() is None
    if importlib.util.find_spec("torch") is not None:
        from cmlcluster.pytorch.store import SessionStore

        store = SessionStore("127.0.0.1")
        try:
            assert store.port > 0
        finally:
            store.close()
    if importlib.util.find_spec("horovod") is not None:
        shown = subprocess.run([*_horovodrun(), "--version"], capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr[-2000:]
    # The reaper of a session that never was: it waits for its stdin's end, then finds nothing to remove.
    reaper = subprocess.run(
        python_module("cmlcluster.backends.docker.reaper", os.urandom(8).hex()),
        input=b"",
        capture_output=True,
        timeout=60,
    )
    assert b"the notebook folder" not in reaper.stderr, reaper.stderr
    assert marks_left(notebook_folder) == {}


def test_python_m_itself_imports_from_the_working_folder(notebook_folder):
    # What the test above guards against, shown: the same start as `python -m`, without the guard.
    import sys

    subprocess.run([sys.executable, "-m", "cmlcluster.backends.docker.reaper"], capture_output=True, timeout=60)
    assert marks_left(notebook_folder)
