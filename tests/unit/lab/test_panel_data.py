"""The JupyterLab panel's Python side without a server (cmlcluster/lab/sessions.py), and its committed
bundle: built from the sources as they are, and shipped by pip where Jupyter looks."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

import pytest
import tomllib

from cmlcluster import lab, origin, records, session_summary, stop_socket
from cmlcluster.errors import ConfigError
from cmlcluster.lab import sessions

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import labextension_sources  # noqa: E402

SESSION = "0123456789abcdef"


@pytest.fixture
def state(tmp_path, monkeypatch):
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(folder))
    return folder


# ---------------------------------------------------------------- the bundle


def test_the_committed_bundle_is_built_from_the_sources_as_they_are():
    assert labextension_sources.recorded() == labextension_sources.digest(), (
        "labextension/ changed since the bundle in cmlcluster/lab/labextension was built: "
        "run `bash scripts/build_labextension.sh` and commit what it writes"
    )


def test_a_changed_source_changes_the_hash(tmp_path, monkeypatch):
    copy = tmp_path / "labextension"
    shutil.copytree(labextension_sources.SOURCES, copy, ignore=shutil.ignore_patterns("node_modules", "lib"))
    monkeypatch.setattr(labextension_sources, "SOURCES", copy)
    before = labextension_sources.digest()
    panel = copy / "src" / "panel.tsx"
    panel.write_text(panel.read_text().replace("Stop all", "Stop everything"))
    assert labextension_sources.digest() != before


def test_the_bundle_loads_only_files_it_has():
    bundle = labextension_sources.BUNDLE
    package = json.loads((bundle / "package.json").read_text())
    assert package["name"] == lab.LABEXTENSION
    entry = bundle / package["jupyterlab"]["_build"]["load"]
    # webpack's chunk names, {id: "hash"}, joined as "<id>.<hash>.js" when loaded
    chunks = {f"{i}.{h}.js" for i, h in re.findall(r'(\d+):"([0-9a-f]{20})"', entry.read_text())}
    assert chunks and all((bundle / "static" / c).is_file() for c in chunks), chunks
    assert {p["dest"] for p in lab._jupyter_labextension_paths()} == {lab.LABEXTENSION}
    assert (ROOT / "cmlcluster" / "lab" / lab._jupyter_labextension_paths()[0]["src"] / "package.json").is_file()


def test_pip_installs_the_whole_bundle_where_jupyterlab_looks_and_enables_the_server_extension():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    installed = {
        f"{target}/{path.name}"
        for target, patterns in setuptools["data-files"].items()
        for pattern in patterns
        for path in ROOT.glob(pattern)
    }
    bundle = labextension_sources.BUNDLE
    shipped = {
        f"share/jupyter/labextensions/{lab.LABEXTENSION}/{p.relative_to(bundle).as_posix()}"
        for p in bundle.rglob("*")
        if p.is_file() and p.name != labextension_sources.RECORD.name
    }
    assert shipped <= installed, shipped - installed
    [config] = [p for p in installed if p.startswith("etc/jupyter/jupyter_server_config.d/")]
    switch = json.loads((ROOT / "jupyter-config" / "jupyter_server_config.d" / config.rpartition("/")[2]).read_text())
    [point] = lab._jupyter_server_extension_points()
    assert switch == {"ServerApp": {"jpserver_extensions": {point["module"]: True}}}


# ---------------------------------------------------------------- a worker log's tail


def kept_log(state: pathlib.Path, worker: str, text: str) -> pathlib.Path:
    folder = state / "logs" / SESSION
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{worker}.log"
    path.write_text(text)
    return path


def test_a_log_tail_is_bounded_and_begins_at_a_line(state):
    kept_log(state, f"{SESSION}-0", "".join(f"line {i}\n" for i in range(10_000)))
    tail = sessions.log_tail(SESSION, f"{SESSION}-0", limit=100)
    assert tail["truncated"] and tail["size"] > 100
    assert tail["text"].startswith("line ") and tail["text"].endswith("line 9999\n")
    assert len(tail["text"]) <= 100
    assert sessions.log_tail(SESSION, f"{SESSION}-0")["text"].endswith("line 9999\n")
    for limit in (0, -1, sessions.MAX_LOG_BYTES + 1):
        with pytest.raises(ConfigError, match=f"bytes={limit}"):
            sessions.log_tail(SESSION, f"{SESSION}-0", limit=limit)


@pytest.mark.parametrize(
    ("session", "worker"),
    [
        ("../../etc", f"{SESSION}-0"),
        (SESSION, "../../../etc/passwd"),
        (SESSION, f"{SESSION}-0/../../x"),
        (SESSION, "fedcba9876543210-0"),  # another session's worker
        (SESSION, f"{SESSION}-0.log"),
        (SESSION.upper(), f"{SESSION.upper()}-0"),
    ],
)
def test_a_log_tail_refuses_anything_but_a_worker_id_of_that_session(state, session, worker):
    kept_log(state, f"{SESSION}-0", "mine\n")
    with pytest.raises(ConfigError, match=r"a session id is|a worker of session"):
        sessions.log_tail(session, worker)


@pytest.mark.timeout(30)
def test_a_log_tail_reads_only_a_regular_file_and_never_waits_on_a_fifo(state):
    log = kept_log(state, f"{SESSION}-0", "")
    log.unlink()
    os.mkfifo(log)  # opened for reading without O_NONBLOCK, this would wait for a writer forever
    with pytest.raises(sessions.NotFound, match="is not a regular file"):
        sessions.log_tail(SESSION, f"{SESSION}-0")
    log.unlink()
    log.mkdir()
    with pytest.raises(sessions.NotFound):
        sessions.log_tail(SESSION, f"{SESSION}-0")


def test_a_live_session_that_keeps_no_logs_says_so_and_shows_no_log_button(state):
    write_record(state, SESSION, workers=[{"id": f"{SESSION}-0", "status": "running"}], logs_kept=False)
    with pytest.raises(sessions.NotFound, match=r"CMLCLUSTER_KEEP_LOGS=0\): its workers' logs stay in its own folder"):
        sessions.log_tail(SESSION, f"{SESSION}-0")
    [live] = sessions.snapshot()["live"]
    assert live["logs_kept"] is False
    other = "fedcba9876543210"
    write_record(state, other)  # an older record, without the field: its logs may be kept, so it asks
    assert {s["id"]: s["logs_kept"] for s in sessions.snapshot()["live"]}[other] is True
    with pytest.raises(sessions.NotFound, match=f"session {other} kept no logs in "):
        sessions.log_tail(other, f"{other}-0")


def test_a_log_tail_follows_no_link_out_of_the_kept_logs(state, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not a log\n")
    log = kept_log(state, f"{SESSION}-0", "")
    log.unlink()
    log.symlink_to(secret)
    with pytest.raises(sessions.NotFound):
        sessions.log_tail(SESSION, f"{SESSION}-0")
    other = "fedcba9876543210"
    (state / "logs" / other).symlink_to(tmp_path)  # a session's folder that is a link
    (tmp_path / f"{other}-0.log").write_text("not a log either\n")
    with pytest.raises(sessions.NotFound):
        sessions.log_tail(other, f"{other}-0")


# ---------------------------------------------------------------- what the panel lists


def write_record(state: pathlib.Path, session_id: str, **fields) -> None:
    mine = origin.this_process().as_strings()
    record = {"id": session_id, "pid": int(mine["pid"]), "origin": mine, "controller": "", "backend": "local"}
    record.update({"started": 1.0, "session_dir": str(state / f"cmlcluster-{session_id}-x"), "workers": [], **fields})
    (state / f"{session_id}.json").write_text(json.dumps(record))


def test_the_snapshot_lists_live_sessions_with_their_notebook_and_kept_ones_without_a_record(state, tmp_path):
    root = tmp_path / "notebooks"
    worker = {"id": f"{SESSION}-2", "status": "running", "hostname": "h", "ip_address": "10.0.0.3", "usage": None}
    write_record(state, SESSION, notebook=str(root / "sub" / "train.ipynb"), workers=[worker], control="")
    kept_log(state, f"{SESSION}-2", "x\n")  # a live session's logs: listed once, as live
    closed = "fedcba9876543210"
    (state / "logs" / closed).mkdir(mode=0o700)
    (state / "logs" / closed / f"{closed}-0.log").write_text("done\n")
    summary = {"notebook": "/elsewhere/a.ipynb", "backend": "docker", "started": 10.0, "ended": 70.0}
    session_summary.write(
        str(state / "logs" / closed),
        {**summary, "outcome": {"failed": 1}, "workers": [{"id": f"{closed}-0", "status": "failed", "exit_code": 1}]},
    )
    snapshot = sessions.snapshot(str(root))
    [live] = snapshot["live"]
    assert live["notebook"] == {"name": "sub/train.ipynb", "path": "sub/train.ipynb"}
    assert live["state"] == origin.ALIVE and live["can_stop"] is False  # no endpoint named
    assert live["workers"] == [
        {
            "id": f"{SESSION}-2",
            "label": "w2",
            "status": "running",
            "host": "h",
            "exit_code": None,
            "usage": None,
            # The widget's words for what it asked for (nothing recorded here) and uses (no sample yet).
            "cpu_text": "0",
            "memory_text": "0 GiB",
            "gpu_text": "",
        }
    ]
    [kept] = snapshot["kept"]
    assert kept["id"] == closed and kept["state"] == "closed" and kept["outcome"] == "1 failed"
    assert kept["notebook"] == {"name": "/elsewhere/a.ipynb", "path": None}  # outside the server's root
    assert kept["workers"] == [{"id": f"{closed}-0", "label": "w0", "status": "failed", "exit_code": 1, "log": True}]


def test_a_socket_that_answers_no_json_is_no_stop_endpoint(monkeypatch):
    import socket
    import tempfile
    import threading

    state = pathlib.Path(tempfile.mkdtemp(prefix="lab-", dir="/tmp"))  # short: a socket's path is at most 107 bytes
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(state))
    own = state / f"cmlcluster-{SESSION}-x"
    own.mkdir(mode=0o700)
    path = own / stop_socket.SOCKET_NAME
    write_record(state, SESSION, control=str(path))
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)

    def answer_nonsense() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"<html>not a stop endpoint</html>\n")

    thread = threading.Thread(target=answer_nonsense)
    thread.start()
    try:
        # An OSError, which the panel's stop answers as a 404 saying why (no ValueError, no 500).
        with pytest.raises(sessions.NotFound, match=r"answered b'<html>not a stop endpoint</html>', not JSON"):
            sessions.stop(SESSION, None)
    finally:
        thread.join(10)
        server.close()
        shutil.rmtree(state)


def test_stop_asks_only_a_live_session_and_only_the_socket_in_its_own_folder(state):
    with pytest.raises(sessions.NotFound, match="no live session"):
        sessions.stop(SESSION, None)
    # A short folder: pytest's tmp_path under the run's TMPDIR can pass a Unix socket's 107 bytes.
    folder = tempfile.mkdtemp(prefix="sock-")
    elsewhere = os.path.join(folder, "elsewhere.sock")
    stopped: list = []
    served = stop_socket.StopEndpoint(elsewhere, lambda ids: stopped.append(ids) or [])
    try:
        write_record(state, SESSION, control=elsewhere)  # a record naming a socket outside its folder
        assert records.records()[0]["state"] == origin.ALIVE
        with pytest.raises(sessions.NotFound, match="serves no stop endpoint"):
            sessions.stop(SESSION, None)
        assert stopped == []
        assert stop_socket.request(elsewhere, ["a"]) == []  # it serves: only the record's claim was refused
        assert stopped == [["a"]]
    finally:
        served.close()
        closed_removes_it = not os.path.exists(elsewhere)
        shutil.rmtree(folder, ignore_errors=True)
    assert closed_removes_it
