"""_lifeline.py --for-each-line: what lives beyond this machine (a session's Slurm jobs) ends when the session's
process does, told of each thing as it starts."""

from __future__ import annotations

import json
import subprocess
import sys

from cmlcluster import _lifeline


def test_each_line_is_the_last_argument_of_one_command_once_the_input_closes(tmp_path):
    said = tmp_path / "said"
    record = [sys.executable, "-c", f"import sys; open({str(said)!r}, 'a').write(sys.argv[1] + '\\n')"]
    lifeline = subprocess.Popen(
        [sys.executable, _lifeline.__file__, "--for-each-line", json.dumps(record)],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    assert lifeline.stdin is not None
    for name in ("--name=job-1", "--name=job-2", "", "--name=job-1"):  # an empty line, a name said twice
        lifeline.stdin.write(f"{name}\n".encode())
    lifeline.stdin.flush()
    assert not said.exists()  # nothing runs while the session lives
    lifeline.stdin.close()  # as when the session's process dies: the last holder of the pipe's end goes
    assert lifeline.wait(30) == 0
    assert sorted(said.read_text().splitlines()) == ["--name=job-1", "--name=job-2"]


def test_a_command_that_cannot_start_does_not_keep_the_others_from_running(tmp_path):
    lifeline = subprocess.run(
        [sys.executable, _lifeline.__file__, "--for-each-line", json.dumps([str(tmp_path / "no-such-command")])],
        input=b"a\nb\n",
        timeout=30,
    )
    assert lifeline.returncode == 0
