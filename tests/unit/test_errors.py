"""cmlcluster's own errors in a notebook: the message and a hint, not screens of cmlcluster's frames; `%tb`,
`%xmode` and plain Python show the whole traceback. Through a real IPython shell (the `shell` fixture)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cmlcluster.errors import TB_HINT

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shown(capsys) -> list[str]:
    """The lines a cell's output showed, colours dropped, blank lines left out."""
    out, err = capsys.readouterr()
    return [line for line in ANSI.sub("", out + err).splitlines() if line.strip()]


# Each cell fails inside cmlcluster, below a few of its frames, before anything starts (the fake backend).
CELLS = {
    "unknown worker id": ("cmlcluster.await_workers(['w-nope'])", r"ConfigError: 'w-nope' is not a worker of session"),
    "too many GPUs": (
        "cmlcluster.launch_workers(1, cpu=1, memory=1, nvidia_gpu=8)",
        r"ConfigError: nvidia_gpu=8 for 1 workers needs 8 GPUs",
    ),
    "missing script": (
        "cmlcluster.launch_workers(1, cpu=1, memory=1, script='no/such/train.py')",
        r"ConfigError: script='no/such/train.py': no such file",
    ),
    "misspelled backend": ("cmlcluster.Session('lcoal')", r"ConfigError: .*'lcoal'"),
}


@pytest.fixture
def fake_shell(shell):
    shell.run_cell("import cmlcluster\ncmlcluster.use_backend('fake')")
    yield shell
    shell.run_line_magic("xmode", "Context")  # IPython's default, for the next test


@pytest.mark.parametrize("case", list(CELLS))
def test_a_cmlcluster_error_shows_as_its_message_and_a_hint_and_percent_tb_shows_the_chain(fake_shell, case, capsys):
    cell, message = CELLS[case]
    capsys.readouterr()
    result = fake_shell.run_cell(cell)
    assert result.error_in_exec is not None
    lines = shown(capsys)
    assert len(lines) == 2, lines
    assert re.match(message, lines[0]), lines
    assert lines[1] == TB_HINT

    fake_shell.run_line_magic("tb", "")
    full = "\n".join(shown(capsys))
    assert "Traceback" in full and "cmlcluster/" in full, full  # cmlcluster's frames, where it was raised
    assert re.search(message, full) and TB_HINT not in full, full


def test_the_chain_stays_under_percent_tb_and_any_mode_chosen_with_xmode(fake_shell, capsys):
    fake_shell.run_cell(
        "from cmlcluster import BackendError\n"
        "def start():\n"
        "    try:\n"
        "        raise OSError('disk full')\n"
        "    except OSError as e:\n"
        "        raise BackendError('could not start worker w0: disk full') from e\n"
    )
    capsys.readouterr()
    fake_shell.run_cell("start()")
    assert shown(capsys) == ["BackendError: could not start worker w0: disk full", TB_HINT]

    fake_shell.run_line_magic("tb", "")
    full = "\n".join(shown(capsys))
    assert "OSError: disk full" in full and "direct cause of the following exception" in full, full

    for mode in ("Plain", "Verbose"):
        fake_shell.run_line_magic("xmode", mode)
        capsys.readouterr()
        fake_shell.run_cell("start()")
        full = "\n".join(shown(capsys))
        assert "OSError: disk full" in full and TB_HINT not in full, (mode, full)


def test_a_workers_traceback_is_shown_whole_without_cmlclusters_frames(fake_shell, capsys):
    remote = "w1 failed:\nTraceback (most recent call last):\n  File \"train.py\", line 3, in <module>\nKeyError: 'lr'"
    fake_shell.run_cell(f"def fail():\n    raise cmlcluster.WorkerError({remote!r}, 'w1')\n")
    capsys.readouterr()
    fake_shell.run_cell("fail()")
    assert shown(capsys) == ["WorkerError: w1 failed:", *remote.splitlines()[1:], TB_HINT]


def test_plain_python_shows_the_whole_traceback():
    code = "import cmlcluster\ncmlcluster.launch_workers(1, cpu=0, memory=1)"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 1
    assert "Traceback (most recent call last)" in ran.stderr and "validate_launch" in ran.stderr, ran.stderr
    assert TB_HINT not in ran.stderr
