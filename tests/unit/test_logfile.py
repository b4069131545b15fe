"""A worker's log in bounded space (cmlcluster.logfile): its head, a rolling tail and a marker between;
and the pipe that a worker's process writes into, copied by a thread that loses nothing and leaves nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time

import pytest

from cmlcluster import cgroups, logfile, resources
from cmlcluster.logfile import CappedLog, WorkerOutput, read_tail, start_process

MARKER = re.compile(rb"\n?\[cmlcluster: ([\d,]+) bytes of output dropped here; [^\]]*\]\n")


def parts(path) -> tuple[bytes, int, bytes]:
    """(head, bytes dropped, tail) of a log that has rolled."""
    data = open(path, "rb").read()
    found = MARKER.search(data)
    assert found, data[:200]
    return data[: found.start()], int(found.group(1).replace(b",", b"")), data[found.end() :]


def lines(start: int, stop: int) -> bytes:
    return b"".join(b"line %d %s\n" % (i, b"x" * (i % 50)) for i in range(start, stop))


def test_a_log_within_its_head_and_tail_is_all_there(tmp_path):
    path = tmp_path / "w.log"
    written = lines(0, 200)
    with CappedLog(str(path), head=1000, tail=len(written)) as log:
        for i in range(0, len(written), 7):
            log.write(written[i : i + 7])
    assert path.read_bytes() == written and log.dropped == 0


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "without"])
def test_many_small_writes_keep_the_head_and_a_rolling_tail_with_a_marker_that_counts_what_went(
    tmp_path, monkeypatch, kernel_copy
):
    if not kernel_copy:  # macOS, or a filesystem that refuses it
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    path = tmp_path / "w.log"
    head, tail = 4096, 16384
    written = lines(0, 50_000)
    with CappedLog(str(path), head=head, tail=tail) as log:
        for n, i in enumerate(range(0, len(written), 40)):
            log.write(written[i : i + 40])
            if n % 500 == 0:
                assert path.stat().st_size <= head + tail + 200
    kept_head, dropped, kept_tail = parts(path)
    assert kept_head == written[:head]
    assert written.endswith(kept_tail) and tail // 2 <= len(kept_tail) <= tail
    assert kept_tail.startswith(b"line ")  # the tail begins at a line's start
    assert dropped == log.dropped == len(written) - head - len(kept_tail)


def test_one_huge_write_keeps_the_default_head_and_the_last_part(tmp_path):
    path = tmp_path / "w.log"
    written = lines(0, 600_000)  # about 22 MiB at once
    assert len(written) > 2 * (logfile.HEAD_BYTES + logfile.TAIL_BYTES)
    with CappedLog(str(path)) as log:
        log.write(written)
        log.write(b"the last line\n")
    kept_head, dropped, kept_tail = parts(path)
    assert kept_head == written[: logfile.HEAD_BYTES]
    assert logfile.TAIL_BYTES // 2 <= len(kept_tail) <= logfile.TAIL_BYTES
    assert kept_tail.endswith(b"line 599999 " + b"x" * 49 + b"\nthe last line\n")
    assert dropped == len(written) + 14 - logfile.HEAD_BYTES - len(kept_tail)
    assert path.stat().st_size < logfile.HEAD_BYTES + logfile.TAIL_BYTES + 200
    assert sorted(os.listdir(tmp_path)) == ["w.log"]  # nothing of a roll left beside it


def test_read_tail_reads_across_a_roll_and_up_into_the_marker_and_the_head(tmp_path):
    path = str(tmp_path / "w.log")
    log = CappedLog(path, head=100, tail=1000)
    numbered = [b"%04d%s\n" % (i, b"x" * 15) for i in range(60)]  # 20 bytes a line
    before, after = b"".join(numbered[:40]), b"".join(numbered[40:])
    log.write(before)  # 100 of head, 700 of tail: no roll yet
    assert read_tail(path, 10**6) == before.decode() and log.dropped == 0
    log.write(after)  # the tail would pass 1000 bytes: it rolls
    assert log.dropped > 0
    everything = before + after
    for limit in (10, 100, 500):  # at most the half that a roll keeps
        assert read_tail(path, limit) == everything[-limit:].decode()
    whole = read_tail(path, 10**6)
    assert whole.startswith(everything[:100].decode()) and "bytes of output dropped here" in whole
    assert whole == open(path).read()
    log.close()
    assert read_tail(str(tmp_path / "none.log"), 100) == ""


def open_fds() -> dict[str, str]:
    """This process's descriptors of the kinds a worker's output holds (pipes, FIFOs, files), with what each
    names. Sockets and event-loop descriptors are left out: another test's thread in this process (xdist
    runs many files in one) may open and close those at any time, and a CI run saw two appear."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listed (listdir's own descriptor among them)
            continue
        if target.startswith(("pipe:", "/")):
            found[fd] = target
    return found


def fds_left(before: dict[str, str]) -> dict[str, str]:
    """Descriptors open now that were not `before` (an output's copy thread closes its own as its last act)."""
    deadline = time.monotonic() + 5
    while (new := {fd: t for fd, t in open_fds().items() if before.get(fd) != t}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return new


def output_threads() -> list[str]:
    """Copy threads still alive after 5 s: one settles `ended` as its last act, and may not have returned yet."""
    copying = [t for t in threading.enumerate() if t.name.startswith("cmlcluster-output-")]
    for thread in copying:
        thread.join(5)
    return [t.name for t in copying if t.is_alive()]


@pytest.fixture
def small_logs(monkeypatch):
    monkeypatch.setattr(logfile, "HEAD_BYTES", 8192)
    monkeypatch.setattr(logfile, "TAIL_BYTES", 65536)


PRINTER = "import sys; print('first line'); [print('line', i, 'x' * 90) for i in range(30000)]; print('the last line')"


def test_what_a_process_writes_is_copied_capped_and_all_in_once_drained(tmp_path, small_logs):
    fds = open_fds()
    path = str(tmp_path / "w.log")

    async def main() -> WorkerOutput:
        process, output = await start_process(path, sys.executable, "-c", PRINTER)
        assert output.write_fd == -1  # only the process writes to the pipe: its end is the pipe's
        await process.wait()
        await output.drain(5)
        return output

    output = asyncio.run(main())
    head, dropped, tail = parts(path)
    assert head.startswith(b"first line\n") and tail.endswith(b"line 29999 " + b"x" * 90 + b"\nthe last line\n")
    assert os.path.getsize(path) <= 8192 + 65536 + 200 and dropped > 2_000_000
    assert output.ended and output_threads() == [] and fds_left(fds) == {}


def test_a_slow_log_slows_the_writer_and_loses_nothing(tmp_path, monkeypatch):
    write = CappedLog.write

    def slow_write(self, data):
        time.sleep(0.01)
        write(self, data)

    monkeypatch.setattr(CappedLog, "write", slow_write)
    path = str(tmp_path / "w.log")
    code = "import sys; [sys.stdout.write('%06d %s\\n' % (i, 'y' * 200)) for i in range(20000)]"

    async def main() -> None:
        process, output = await start_process(path, sys.executable, "-c", code)
        await process.wait()
        await output.drain(30)

    asyncio.run(main())
    assert open(path).read() == "".join(f"{i:06d} {'y' * 200}\n" for i in range(20000))


def test_a_log_that_cannot_grow_is_said_once_and_never_blocks_its_worker(tmp_path, monkeypatch, caplog):
    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CappedLog, "write", full)
    path = str(tmp_path / "w.log")

    async def main() -> int | None:
        process, output = await start_process(path, sys.executable, "-c", PRINTER)
        await asyncio.wait_for(process.wait(), 30)  # it printed 3 MB through a 64 KiB pipe: all was read
        await output.drain(5)
        return process.returncode

    with caplog.at_level(logging.WARNING, logger="cmlcluster.logfile"):
        assert asyncio.run(main()) == 0
    [said] = caplog.records
    assert "No space left on device" in said.getMessage() and path in said.getMessage()


def test_a_fifo_is_read_once_another_process_opens_it_and_is_gone_once_handed_over(tmp_path):
    fds = open_fds()
    path, fifo = str(tmp_path / "w.log"), str(tmp_path / "w.output")
    # What the local template does: opens the FIFO, hands it to the worker, closes its own.
    writer = (
        "import os, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY); os.write(fd, b'opened\\n'); "
        "time.sleep(0.5); os.write(fd, b'after the hand-over\\n')"
    )

    async def main() -> None:
        output = WorkerOutput(path, fifo=fifo)
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", writer, fifo)
        while b"opened" not in open(path, "rb").read():
            await asyncio.sleep(0.01)
        output.handed_over()
        assert not os.path.exists(fifo)
        await process.wait()
        await output.drain(5)
        assert output.ended

    asyncio.run(main())
    assert open(path).read() == "opened\nafter the hand-over\n"
    assert output_threads() == [] and fds_left(fds) == {} and os.listdir(tmp_path) == ["w.log"]


def test_a_copy_whose_writer_outlives_the_drain_stops_and_lets_go(tmp_path):
    fds = open_fds()
    path = str(tmp_path / "w.log")
    holder = "import time; print('holding', flush=True); time.sleep(60)"

    async def main() -> None:
        process, output = await start_process(path, sys.executable, "-c", holder)
        try:
            while "holding" not in read_tail(path, 100):
                await asyncio.sleep(0.01)
            started = time.monotonic()
            await output.drain(0.5)  # the process lives on, holding the pipe
            assert 0.5 <= time.monotonic() - started < 5 and output.ended
        finally:
            process.kill()
            await process.wait()

    asyncio.run(main())
    assert open(path).read() == "holding\n"
    assert output_threads() == [] and fds_left(fds) == {}


def test_missing_cpu_memory_limits_are_said_once_at_warning_with_why_and_what_to_do(monkeypatch, caplog):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", "/dev/null/cgroup")  # nothing can be made below a file
    notice = resources.LimitsNotice()
    with caplog.at_level(logging.DEBUG, logger="cmlcluster"):
        for worker in ("w0", "w1", "w2"):
            limits = cgroups.CgroupLimits(f"cmlcluster-test/{worker}", 1, 1)
            limits.add(os.getpid())
            notice.check(limits)
            limits.remove()
    [said] = [r for r in caplog.records if r.name.startswith("cmlcluster")]
    assert said.levelno == logging.WARNING
    assert "not applied to local workers" in said.getMessage()
    assert "/dev/null/cgroup" in said.getMessage() or "no cgroup" in said.getMessage()
    assert "apply_limits=False" in said.getMessage() and "docker backend" in said.getMessage()


def test_a_log_is_the_users_alone_from_its_start_through_its_rolls_whatever_the_umask(tmp_path):
    path = tmp_path / "w.log"
    path.write_bytes(b"an older log, readable by all\n")
    os.chmod(path, 0o644)
    old = os.umask(0o022)
    try:
        with CappedLog(str(path), head=16, tail=64) as log:
            assert os.stat(path).st_mode & 0o777 == 0o600
            for _ in range(20):
                log.write(b"a line of output\n")
            assert log.dropped  # it rolled: the file is a new one
            assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
