"""TensorBoard for a session (cmlcluster.tensorboard_server; cdsw.tensorboard), with real TensorBoard processes.

Each start takes a few seconds (TensorBoard imports TensorFlow), so the checks that only read
share one server (`board`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psutil
import pytest
from harness.processes import command_line, own_tree

from cmlcluster.errors import CmlClusterError, ConfigError
from cmlcluster.tensorboard_server import DEFAULT_PORT, TensorBoard

pytestmark = pytest.mark.integration


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through $http_proxy
    with opener.open(url, timeout=timeout) as response:
        return response.status, response.read()


def status_of(url: str) -> int:
    """The HTTP status `url` answers with (an error status included)."""
    try:
        return get(url)[0]
    except urllib.error.HTTPError as e:
        return e.code


def token_of(board: TensorBoard) -> str:
    match = re.fullmatch(rf"http://127\.0\.0\.1:{board.port}/([A-Za-z0-9_-]{{22}})/", board.url)
    assert match, board.url
    return match.group(1)


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except ConnectionRefusedError:
        return True
    return False


def group_members(pgid: int) -> list[int]:
    found = []
    for proc in own_tree():
        with contextlib.suppress(psutil.Error):
            if os.getpgid(proc.pid) == pgid:
                found.append(proc.pid)
    return found


def tensorboards_under(folder: str, but: str) -> list[psutil.Process]:
    """TensorBoard processes reading a logdir in `folder`, save those naming `but`."""
    found = []
    for proc in own_tree():
        cmdline = command_line(proc)
        if but in cmdline:
            continue
        if "tensorboard" in cmdline and folder in cmdline:
            found.append(proc)
    return found


@pytest.fixture(autouse=True)
def no_tensorboard_left(tmp_path_factory):
    """After each test: no TensorBoard of this run's logdirs (the shared `board` excepted until its end)."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    deadline = time.monotonic() + 10
    left = tensorboards_under(base, but="shared-logs")
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tensorboards_under(base, but="shared-logs")
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, f"TensorBoard processes left behind: {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("shared-logs") / "not-written-yet"
    session_dir = tmp_path_factory.mktemp("session")
    started = time.monotonic()
    with TensorBoard.start(str(logdir), session_dir=str(session_dir)) as tb:
        tb.startup_seconds = time.monotonic() - started  # type: ignore[attr-defined]
        yield tb
    assert tb.poll() is not None


def test_it_answers_http_on_127_0_0_1_with_its_logdir(board):
    print(f"TensorBoard answered {board.startup_seconds:.1f} s after start()")
    assert board.url == f"http://127.0.0.1:{board.port}/{token_of(board)}/"
    status, page = get(board.url)
    assert status == 200
    assert b"tb-relative-root" in page  # TensorBoard's index page, which loads everything by relative URL
    status, environment = get(board.url + "data/environment")
    assert json.loads(environment)["data_location"] == board.logdir
    assert board.logdir.endswith("not-written-yet") and os.path.isabs(board.logdir)
    assert not os.path.exists(board.logdir)  # not created: TensorBoard shows it once training writes it
    assert "tensorboard.main" in psutil.Process(board.pid).cmdline()
    assert board.poll() is None
    assert "running" in repr(board) and board.url in repr(board)


def test_it_is_not_reachable_on_the_machines_other_addresses(board):
    others = [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not others:
        pytest.fail(
            "this machine has no IPv4 address but loopback, so nothing shows that TensorBoard listens on "
            "127.0.0.1 only: run this test where a network interface (eth0, docker0) has an address"
        )
    assert not refused("127.0.0.1", board.port)  # it is there...
    assert [a for a in others if not refused(a, board.port)] == [], "TensorBoard answers beyond 127.0.0.1"
    if socket.has_ipv6:  # ...and not on IPv6 loopback either
        with pytest.raises(OSError):
            socket.create_connection(("::1", board.port), timeout=3).close()


def test_without_its_token_every_request_is_refused_and_no_command_line_holds_the_token(board):
    root = f"http://127.0.0.1:{board.port}"
    wrong = "x" * 22
    for path in ("/", "/data/environment", "/data/runs", f"/{wrong}/", f"/{wrong}/data/environment"):
        assert status_of(root + path) == 404, path
    assert status_of(board.url) == status_of(board.url + "data/environment") == 200
    group = group_members(os.getpgid(board.pid))
    assert group and not [pid for pid in group if token_of(board) in command_line(psutil.Process(pid))]
    assert not [name for name in os.listdir(os.path.dirname(board.log_path)) if name.endswith(".flags")]


def listening_ports(pgid: int) -> set[int]:
    """The ports that the processes of TensorBoard's group (and below its lifeline) listen on."""
    processes = {*group_members(pgid), pgid, *(p.pid for p in psutil.Process(pgid).children(recursive=True))}
    ports = set()
    for pid in processes:
        with contextlib.suppress(psutil.Error):
            ports |= {c.laddr.port for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"}
    return ports


def write_scalars(folder: str) -> None:
    """An event file of three `loss` scalars (steps 0-2) in `folder`."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(folder)
    for step in range(3):
        value = summary_pb2.Summary.Value(tag="loss", simple_value=1 / (step + 1))
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value])))
    writer.close()


def test_it_serves_the_scalars_on_its_one_port_only_no_data_server_beside_it(tmp_path):
    # TensorBoard's default --load_fast=auto starts its Rust data server (tensorboard-data-server, where
    # installed) on another port of 127.0.0.1, which serves every log under logdir over gRPC, no token asked.
    write_scalars(str(tmp_path / "logs" / "run1"))
    started = time.monotonic()
    with TensorBoard.start(str(tmp_path / "logs"), session_dir=str(tmp_path)) as tb:
        answered = time.monotonic() - started
        scalars = tb.url + "data/plugin/scalars/scalars?run=run1&tag=loss"
        while True:  # TensorBoard reads the logdir in the background, after it answers
            with contextlib.suppress(urllib.error.HTTPError):
                points = json.loads(get(scalars)[1])
                break
            assert time.monotonic() - started < 60, "TensorBoard served no scalars in 60 s"
            time.sleep(0.2)
        served = time.monotonic() - started
        print(f"TensorBoard answered {answered:.1f} s and served the scalars {served:.1f} s after start()")
        assert [(step, value) for _, step, value in points] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
        assert "loss" in json.loads(get(tb.url + "data/plugin/scalars/tags")[1])["run1"]
        assert status_of(f"http://127.0.0.1:{tb.port}/data/plugin/scalars/scalars?run=run1&tag=loss") == 404
        assert listening_ports(os.getpgid(tb.pid)) == {tb.port}


def test_its_log_is_a_file_in_the_session_folder_not_the_notebook(board, capfd):
    assert os.path.dirname(board.log_path) != ""
    with open(board.log_path) as f:
        assert f"http://127.0.0.1:{board.port}/" in f.read()
    out, err = capfd.readouterr()
    assert "TensorBoard" not in out + err


def test_the_notebook_link_goes_through_jupyter_server_proxy_when_there_is_one(board, monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.delenv("TENSORBOARD_PROXY_URL", raising=False)
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    monkeypatch.delenv("JPY_PARENT_PID", raising=False)

    def without_proxy(name, *args):
        return None if name == "jupyter_server_proxy" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_proxy)
    assert board.browser_url == board.url
    assert f'href="{board.url}"' in board._repr_html_()

    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "jupyter_server_proxy" else None
    )
    token = token_of(board)
    assert board.browser_url == board.url  # installed, but no notebook server started this process
    # A kernel of a plain jupyter server: its base URL from the jpserver-<pid>.json it keeps.
    (tmp_path / "jpserver-4242.json").write_text('{"base_url": "/"}')
    monkeypatch.setenv("JPY_PARENT_PID", "4242")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    assert board.browser_url == f"/proxy/{board.port}/{token}/"
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/alice/")
    assert board.browser_url == f"/user/alice/proxy/{board.port}/{token}/"
    assert f'href="/user/alice/proxy/{board.port}/{token}/"' in board._repr_html_()
    monkeypatch.setenv("TENSORBOARD_PROXY_URL", "/lab/proxy/%PORT%/")  # TensorBoard's own setting wins
    assert board.browser_url == f"/lab/proxy/{board.port}/{token}/"


def test_stop_ends_its_process_group_closes_the_port_and_removes_its_temp_log(tmp_path, wait_gone):
    tb = TensorBoard.start(str(tmp_path / "logs"))
    pid, pgid, port, log_path = tb.pid, os.getpgid(tb.pid), tb.port, tb.log_path
    assert pgid != os.getpgid(0) and pgid != pid  # a group of its own, led by the lifeline
    members = group_members(pgid)
    assert len(members) >= 2
    assert os.path.exists(log_path) and os.path.basename(log_path).startswith("cmlcluster-tensorboard-")
    tb.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert wait_gone(members, within=2) == []
    assert group_members(pgid) == []
    assert refused("127.0.0.1", port)
    assert not os.path.exists(log_path)
    assert tb.poll() == 0  # the lifeline passed TERM on and TensorBoard exited cleanly
    tb.stop()  # idempotent
    assert "stopped" in repr(tb) and "stopped" in tb._repr_html_()
    # A TensorBoard started next on the same port has another token: the old link leads nowhere.
    with TensorBoard.start(str(tmp_path / "logs"), port=port) as again:
        assert again.url != tb.url
        assert status_of(tb.url) == 404 and status_of(again.url) == 200


def test_it_takes_another_free_port_when_6006_is_taken(tmp_path):
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            holder.bind(("127.0.0.1", DEFAULT_PORT))
            holder.listen()
        except OSError:
            pass  # something else on this machine holds it already: taken all the same
        with TensorBoard.start(str(tmp_path / "logs"), session_dir=str(tmp_path)) as tb:
            assert tb.port != DEFAULT_PORT
            assert get(tb.url)[0] == 200
        with pytest.raises(CmlClusterError, match=f"port {DEFAULT_PORT} .* in use"):
            TensorBoard.start(str(tmp_path / "logs"), port=DEFAULT_PORT)
    finally:
        holder.close()


OWNER = """
import os, sys, time
from cmlcluster.tensorboard_server import TensorBoard
tb = TensorBoard.start(sys.argv[1], session_dir=sys.argv[2])
print(tb.pid, os.getpgid(tb.pid), tb.port, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owner_takes_its_tensorboard_with_it(tmp_path, wait_gone):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "logs"), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        ready, _, _ = select.select([owner.stdout], [], [], 90)
        line = owner.stdout.readline() if ready else ""
        assert line, f"the owner printed no TensorBoard pid (exit code {owner.poll()})"
        pid, pgid, port = map(int, line.split())
        members = group_members(pgid)
        assert pid in members and len(members) >= 2
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    started = time.monotonic()
    assert wait_gone(members, within=5) == []
    print(f"TensorBoard's group was gone {time.monotonic() - started:.2f} s after its owner's SIGKILL")
    assert group_members(pgid) == []
    assert refused("127.0.0.1", port)
    # Killed outright, TensorBoard could not remove its record of itself (TensorBoard's own folder, not ours).
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(tempfile.gettempdir(), ".tensorboard-info", f"pid-{pid}.info"))


@pytest.mark.parametrize("logdir", ["", "   ", None, 42, b"logs", ["logs"]])
def test_a_bad_logdir_is_refused_before_anything_starts(logdir, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="logdir=") as error:
        TensorBoard.start(logdir)
    assert repr(logdir) in str(error.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_other_bad_arguments_are_refused_naming_the_value(tmp_path):
    a_file = tmp_path / "events.txt"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        TensorBoard.start(str(a_file))
    for port in (0, 70000, "6006", True):
        with pytest.raises(ConfigError, match=f"port={port!r}"):
            TensorBoard.start(str(tmp_path), port=port)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="session_dir="):
        TensorBoard.start(str(tmp_path), session_dir=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="timeout="):
        TensorBoard.start(str(tmp_path), timeout=0)


def test_without_tensorboard_installed_it_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else find_spec(n, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        TensorBoard.start(str(tmp_path))


def test_a_tensorboard_that_exits_at_once_raises_quoting_its_log_and_leaves_nothing(tmp_path, monkeypatch):
    import cmlcluster.tensorboard_process as process

    monkeypatch.setattr(process, "RELOAD_INTERVAL", "soon")  # a flag value TensorBoard refuses, exiting with 2
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its private log goes
    with pytest.raises(CmlClusterError, match="exited with code 2 before answering") as error:
        TensorBoard.start(str(tmp_path / "logs"))
    assert "--reload_interval: invalid float: 'soon'" in str(error.value)  # its own complaint, quoted
    assert os.listdir(tmp_path) == []  # its private log is removed


def test_cdsw_tensorboard_belongs_to_the_default_session_and_stops_with_it(tmp_path):
    import cmlcluster as cdsw

    board = cdsw.tensorboard(str(tmp_path / "logs"))
    try:
        assert get(board.url)[0] == 200
        assert board.logdir == str(tmp_path / "logs")
    finally:
        cdsw.stop_session()
    assert board.poll() is not None
    assert refused("127.0.0.1", board.port)
    assert not psutil.pid_exists(board.pid) or psutil.Process(board.pid).status() == psutil.STATUS_ZOMBIE
