"""_lifeline.py --for-each-line: what lives beyond this machine (a session's Slurm jobs) ends when the session's
process does, told of each thing as it starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

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


@pytest.mark.parametrize("kind", ["popen", "asyncio"])
def test_a_guarded_write_end_is_not_held_by_a_child_this_process_forks(kind):
    async def start_async():
        return await asyncio.create_subprocess_exec(
            sys.executable, _lifeline.__file__, "--", "sleep", "60", stdin=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip

    loop = asyncio.new_event_loop()
    try:
        if kind == "popen":
            held = subprocess.Popen(
                [sys.executable, _lifeline.__file__, "--", "sleep", "60"], stdin=subprocess.PIPE, start_new_session=True
            )
        else:
            held = loop.run_until_complete(start_async())
        _lifeline.guard_stdin(held)
        forked = os.fork()
        if forked == 0:  # what multiprocessing's "fork" does: no exec, every descriptor copied
            time.sleep(30)
            os._exit(0)
        try:
            if kind == "popen":
                held.stdin.close()
            else:
                held.stdin.transport.close()
                loop.run_until_complete(asyncio.sleep(0.1))  # the transport lets go of its pipe on the loop
            deadline = time.monotonic() + 10
            while _alive(held.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(held.pid)  # its input ended though the forked child lives
        finally:
            os.kill(forked, signal.SIGKILL)
            os.waitpid(forked, 0)
            if kind == "popen":
                held.wait(5)
            else:
                loop.run_until_complete(held.wait())
    finally:
        loop.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
