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


def test_env_line_gives_the_command_variables_no_command_line_shows_and_the_rest_of_stdin_is_the_lifeline():
    command = [sys.executable, "-c", "import os, time; print(os.environ['WORKER_KEY'], flush=True); time.sleep(60)"]
    lifeline = subprocess.Popen(
        [sys.executable, _lifeline.__file__, "--term-first", "5", "--env-line", "--", *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert lifeline.stdin is not None and lifeline.stdout is not None
    lifeline.stdin.write(json.dumps({"WORKER_KEY": "s3cret"}).encode() + b"\n")
    lifeline.stdin.flush()
    assert lifeline.stdout.readline() == b"s3cret\n"
    with open(f"/proc/{lifeline.pid}/cmdline", "rb") as f:
        assert b"s3cret" not in f.read()
    lifeline.stdin.close()  # the session (its ssh, on a login node) gone: the command is ended
    assert lifeline.wait(30) != 0


def test_env_line_never_starts_the_command_without_its_variables(tmp_path):
    marker = tmp_path / "ran"
    ended = subprocess.run(
        [sys.executable, _lifeline.__file__, "--env-line", "--", "touch", str(marker)],
        input=b'{"A": "1"',  # the session died mid-line
        capture_output=True,
        timeout=30,
        start_new_session=True,
    )
    assert ended.returncode != 0 and b"before it sent the command's environment" in ended.stderr
    assert not marker.exists()
