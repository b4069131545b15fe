"""Ending a worker's process group (cmlcluster/_proc.py) once its leader has been reaped: what is left of
the group goes, and nothing else does, even when the leader's pid names someone else's group by then.

Pids come round again once the counter wraps (pid_max is 32,768 here, and a full test run wraps it
every few minutes), so a session that closes a worker which finished minutes ago holds a pid that may
now lead another process's group. These tests start only their own processes and signal only them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import psutil

from cmlcluster._proc import end_group, end_group_async, signal_left_of_group


class Reaped:
    """A process that was started and reaped (Popen.wait): its pid and exit code are all that is left."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, 0

    def wait(self) -> int:
        return 0


class ReapedByAsyncio(Reaped):
    async def wait(self) -> int:  # type: ignore[override]
        return 0


def running(process: subprocess.Popen) -> bool:
    return process.poll() is None


def test_a_group_whose_number_a_live_process_holds_again_is_not_signalled():
    # Someone else's process (here, this test's) now leads the group numbered like an old worker's pid.
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert signal_left_of_group(other.pid, 9) is False
        asyncio.run(end_group_async(ReapedByAsyncio(other.pid), grace=1))  # a session closing a finished worker
        end_group(Reaped(other.pid), grace=0.2)  # an SSH host's relay ending its worker once more as it goes
        time.sleep(0.2)
        assert running(other)
    finally:
        other.kill()
        other.wait()


def test_what_a_reaped_leader_left_in_its_group_is_killed():
    # A leader that started a child in its group and exited: the child is what is left of the group.
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '60']).pid)"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    left = int(leader.stdout.readline())
    leader.wait()  # reaped: its pid is free, and still names the group its child is in
    try:
        assert psutil.Process(left).status() != psutil.STATUS_ZOMBIE
        asyncio.run(end_group_async(ReapedByAsyncio(leader.pid), grace=1))
        deadline = time.monotonic() + 10
        while psutil.pid_exists(left) and psutil.Process(left).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "what the leader left in its group is still running"
            time.sleep(0.05)
    finally:
        if psutil.pid_exists(left):
            psutil.Process(left).kill()
        leader.stdout.close()
