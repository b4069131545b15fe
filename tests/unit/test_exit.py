"""How a rank's process ends (cmlcluster._exit): with the status its script decided, after what
Python's exit does while the interpreter is whole, and never with what finalization does after
(where Gloo's threads abort ranks that finished: SIGABRT). Run through the Horovod rank runner,
which needs neither Horovod nor torch; the PyTorch one is run by run_torch in test_torch.py."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import pytest

from cmlcluster._exit import status_of

# Finishes, then aborts as Gloo makes ranks that finished abort, once the interpreter finalizes.
ABORTS_AT_EXIT = pathlib.Path(__file__).parents[1] / "harness" / "aborts_at_exit.py"


def run_rank(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cmlcluster.horovod.rank", script, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_abort_is_real_without_the_rank_runner(tmp_path):
    ran = subprocess.run([sys.executable, ABORTS_AT_EXIT, tmp_path / "log"], capture_output=True, timeout=60)
    assert ran.returncode == -signal.SIGABRT, ran


@pytest.mark.parametrize(
    ("end", "status", "said"),
    [
        ("", 0, ""),
        ("sys.exit()", 0, ""),
        ("sys.exit(3)", 3, ""),
        ("sys.exit('no data in /data')", 1, "no data in /data\n"),
        ("raise ValueError('the shard is corrupt')", 1, "ValueError: the shard is corrupt\n"),
    ],
)
def test_a_rank_exits_as_its_script_decided_whatever_finalization_does(tmp_path, end, status, said):
    script = tmp_path / "train.py"
    script.write_text(ABORTS_AT_EXIT.read_text() + end + "\n")
    ran = run_rank(str(script), str(tmp_path / "log"))
    assert ran.returncode == status, ran
    assert ran.stderr.endswith(said), ran.stderr
    # Python's exit, in its order: the thread that is not a daemon ends, then the atexit handlers
    # run; a file left open loses nothing.
    assert ran.stdout.splitlines() == ["script finished", "thread finished", "atexit handler ran"]
    assert (tmp_path / "log.0").read_text() == "every line written"


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (2, 2), (True, 1), (256, 0), (-1, 255)])
def test_a_system_exit_gives_the_status_python_would(code, status, capsys):
    assert status_of(SystemExit(code)) == status
    assert capsys.readouterr().err == ""


def test_a_system_exit_with_a_message_prints_it_and_is_1(capsys):
    assert status_of(SystemExit("no data in /data")) == 1
    assert capsys.readouterr().err == "no data in /data\n"
