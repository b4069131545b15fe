"""Workers' logs kept after their session (cmlcluster/worker_logs.py): where, the retention rules, and
`cmlcluster logs`. Folders of sessions are crafted here, with the sizes and modification times asked,
in a state folder of the test's own."""

from __future__ import annotations

import os
import re
import time

import pytest

from cmlcluster import worker_logs
from cmlcluster.__main__ import main
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.errors import ConfigError
from cmlcluster.session import Session

pytestmark = pytest.mark.timeout(60)

DAY = 86400.0
NOW = 1_900_000_000.0


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))
    return worker_logs.folder()


def sid(n: int) -> str:
    return f"{n:016x}"


def craft(root: str, n: int, age_days: float, size: int = 10, workers: int = 1, now: float = NOW) -> str:
    """Session sid(n)'s folder, `workers` logs of `size` bytes each, last written `age_days` before `now`."""
    folder = os.path.join(root, sid(n))
    os.makedirs(folder, mode=0o700)
    when = now - age_days * DAY
    for w in range(workers):
        path = os.path.join(folder, f"{sid(n)}-{w}.log")
        with open(path, "wb") as f:
            f.write(b"x" * (size - 1) + b"\n")
        os.utime(path, (when, when))
    os.utime(folder, (when, when))
    return folder


def remaining(root: str) -> set[int]:
    return {int(name, 16) for name in os.listdir(root) if len(name) == 16}


def nothing_runs() -> set[str]:
    return set()


def test_past_fifty_sessions_the_oldest_go(root):
    for n in range(53):
        craft(root, n, age_days=(53 - n) / 10)  # 0 is the oldest, all within 14 days
    removed = worker_logs.prune(root, now=NOW, running=nothing_runs)
    assert removed == [sid(0), sid(1), sid(2)]
    assert remaining(root) == set(range(3, 53))


def test_sessions_older_than_fourteen_days_go_but_not_one_that_still_runs(root):
    for n, age in enumerate([1, 13.9, 14.1, 30, 40]):
        craft(root, n, age_days=age)
    os.makedirs(os.path.join(root, "notes"))  # not a session's: never removed
    removed = worker_logs.prune(root, now=NOW, running=lambda: {sid(4)})
    assert removed == [sid(3), sid(2)]
    assert remaining(root) == {0, 1, 4}
    assert os.path.isdir(os.path.join(root, "notes"))


def test_a_session_counts_as_old_by_its_newest_log(root):
    folder = craft(root, 0, age_days=20, workers=2)
    recent = os.path.join(folder, f"{sid(0)}-1.log")
    os.utime(recent, (NOW - DAY, NOW - DAY))  # a session of three weeks that wrote yesterday
    assert worker_logs.prune(root, now=NOW, running=nothing_runs) == []


def test_past_the_bytes_in_all_the_oldest_go_until_the_rest_fits(root):
    for n in range(6):
        craft(root, n, age_days=6 - n, size=100)
    removed = worker_logs.prune(root, now=NOW, max_bytes=350, keep={sid(0)}, running=nothing_runs)
    assert removed == [sid(1), sid(2), sid(3)]  # the oldest, sid(0), is kept: the session starting
    assert remaining(root) == {0, 4, 5}


def test_nothing_is_asked_or_removed_within_the_rules(root):
    for n in range(3):
        craft(root, n, age_days=n)

    def asked() -> set[str]:
        raise AssertionError("the records were read with nothing to prune")

    assert worker_logs.prune(root, now=NOW, running=asked) == []
    assert remaining(root) == {0, 1, 2}


def test_a_session_start_prunes_and_keeps_its_logs_in_the_state_folder(root):
    craft(root, 1, age_days=15, now=time.time())
    with Session(FakeBackend([FakeWorker()]), echo=False) as s:
        s.launch_workers(1, cpu=1, memory=1)
        assert s.log_folder == os.path.join(root, s.id)
        assert os.stat(s.log_folder).st_mode & 0o777 == 0o700
    assert remaining(root) == {int(s.id, 16)}


def test_the_folder_follows_xdg_state_home_and_is_refused_when_others_may_write(tmp_path, monkeypatch):
    monkeypatch.delenv("CMLCLUSTER_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert worker_logs.folder() == str(tmp_path / "xdg" / "cmlcluster" / "logs")
    os.chmod(tmp_path / "xdg" / "cmlcluster" / "logs", 0o777)
    with pytest.raises(ConfigError, match=r"writable by others.*will not read or write worker logs there"):
        worker_logs.folder()


def test_cmlcluster_logs_prints_a_workers_log_its_last_lines_and_lists_the_sessions(root, capsys):
    folder = craft(root, 7, age_days=0, workers=2, now=time.time())
    with open(os.path.join(folder, f"{sid(7)}-1.log"), "w") as f:
        f.write("first\nsecond\nthe last line\n")
    assert main(["logs", sid(7), "1", "--tail", "1"]) == 0
    assert capsys.readouterr().out == "the last line\n"
    assert main(["logs", sid(7)[:12]]) == 0  # the start of an id, every worker's log
    out = capsys.readouterr().out
    assert f"==> {sid(7)}-0 <==" in out and out.endswith(f"==> {sid(7)}-1 <==\nfirst\nsecond\nthe last line\n")
    assert main(["logs"]) == 0
    assert re.search(
        rf"^{sid(7)} +\? +[-0-9]+ [:0-9]+ +\? +unknown \(an older cmlcluster's session\) +2 ",
        capsys.readouterr().out,
        re.M,
    )
    assert main(["logs", sid(7), "9"]) == 2
    assert f"kept no log of worker '9'; its workers: {sid(7)}-0, {sid(7)}-1" in capsys.readouterr().err


def test_a_logs_folder_others_may_read_is_made_private_and_that_is_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))
    os.makedirs(tmp_path / "state" / "logs", mode=0o700)
    os.chmod(tmp_path / "state" / "logs", 0o755)  # what an older cmlcluster, or a umask of 022, left
    with caplog.at_level("INFO", logger="cmlcluster.worker_logs"):
        root = worker_logs.folder()
        worker_logs.folder()
    assert os.stat(root).st_mode & 0o777 == 0o700
    said = [r.getMessage() for r in caplog.records if "readable by other users" in r.getMessage()]
    assert len(said) == 1 and "mode 0o755" in said[0] and root in said[0]


def test_keep_logs_0_keeps_nothing_after_the_session_yet_shows_its_logs_while_it_runs(root, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_KEEP_LOGS", "0")
    with Session(FakeBackend([FakeWorker()]), echo=False) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1)
        folder = s.log_folder
        assert not folder.startswith(root) and os.path.isdir(folder)  # the session's own folder's
        assert s.worker_log_path(w).startswith(folder)
    assert os.listdir(root) == []
    assert not os.path.exists(folder)


def test_logs_delete_removes_a_sessions_logs_or_all_but_a_running_ones(root, capsys):
    for n in (1, 2, 3):
        craft(root, n, age_days=0, now=time.time())
    assert main(["logs", "--delete", sid(1)]) == 0
    assert remaining(root) == {2, 3}
    assert f"session {sid(1)}: deleted its worker logs" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="still runs"):
        worker_logs.delete(sid(2), running=lambda: {sid(2)})
    assert worker_logs.delete(None, everything=True, running=lambda: {sid(2)}) == 0
    assert remaining(root) == {2}
    assert f"session {sid(2)}: left (it still runs)" in capsys.readouterr().out
    assert main(["logs", "--delete"]) == 2
    assert "give a SESSION, or --all" in capsys.readouterr().err
    assert main(["logs", "--all", "--delete"]) == 0
    assert remaining(root) == set()
