"""`cmlcluster list` and `cleanup` never end a live session: what a record must say before cleanup acts.

A session is gone only when its record is of this machine, boot and PID namespace, no process of
its pid and start time runs, and its controller does not answer (cmlcluster/origin.py). Records are
written here by hand, as another process would have written them, into a state folder of the test's.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys

import pytest

from cmlcluster import origin, records
from cmlcluster.__main__ import cleanup_sessions, list_sessions, main
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.errors import ConfigError
from cmlcluster.session import Session

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def state(tmp_path, monkeypatch):
    folder = tmp_path / "state"
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(folder))
    return folder


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid  # reaped: no process of this pid (until the kernel hands it out again)


def write_record(state, tmp_path, session_id: str, controller: str = "", **where) -> tuple[str, str]:
    """A record as a session with `where` (fields of this process's origin replaced) would write it,
    and its session folder; returns (record path, folder path)."""
    mine = origin.this_process().as_strings()
    state.mkdir(mode=0o700, exist_ok=True)
    session_dir = tmp_path / f"cmlcluster-{session_id}-abc"
    session_dir.mkdir()
    found = {**mine, **{k: str(v) for k, v in where.items()}}
    record = {
        "id": session_id,
        "pid": int(found["pid"]),
        "host": found["host"],
        "origin": found,
        "controller": controller,
        "backend": "local",
        "started": 0,
        "session_dir": str(session_dir),
        "workers": [],
    }
    path = state / f"{session_id}.json"
    path.write_text(json.dumps(record))
    return str(path), str(session_dir)


def cleaned(capsys) -> str:
    capsys.readouterr()
    assert cleanup_sessions(dry_run=False) == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------- which sessions are gone


def test_a_session_of_another_pid_namespace_with_this_host_and_pid_is_left_alone(state, tmp_path, capsys):
    # A devcontainer sharing the hostname: its pid means nothing here, even one that no longer runs here.
    pidns = int(origin.this_process().pidns or 0) + 1
    path, folder = write_record(state, tmp_path, "0123456789abcdef", pid=dead_pid(), pidns=pidns)
    [record] = records.records()
    assert record["state"] == origin.ELSEWHERE
    out = cleaned(capsys)
    assert "session 0123456789abcdef: left alone" in out and "another PID namespace" in out, out
    assert os.path.exists(path) and os.path.isdir(folder)
    capsys.readouterr()
    list_sessions()
    assert "cleanup leaves it" in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace takes root (the README runs tests as root)")
def test_a_live_session_in_a_pid_namespace_of_its_own_is_left_alone(state, tmp_path, capsys):
    # A real process in another PID namespace (as in a devcontainer that shares this hostname): its pid
    # here is another process's, started at another time, so pid and start time alone would call it gone.
    code = (
        "import json, sys, cmlcluster.origin as o\n"
        "print(json.dumps(o.this_process().as_strings()), flush=True)\n"
        "sys.stdin.read()"
    )
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as other:
        try:
            theirs = json.loads(other.stdout.readline())
            mine = origin.this_process().as_strings()
            assert (theirs["host"], theirs["boot"]) == (mine["host"], mine["boot"]) and theirs["pidns"] != mine["pidns"]
            path, folder = write_record(state, tmp_path, "3333333333333333", **theirs)
            assert [r["state"] for r in records.records()] == [origin.ELSEWHERE]
            assert "left alone" in cleaned(capsys)
            assert os.path.exists(path) and os.path.isdir(folder)
        finally:
            other.stdin.close()
            other.wait(timeout=30)


@pytest.mark.parametrize("field", ["host", "boot"])
def test_a_session_of_another_machine_or_boot_is_left_alone(state, tmp_path, capsys, field):
    # Two laptops of one name sharing a Kubernetes namespace: their boot ids differ.
    path, folder = write_record(state, tmp_path, "fedcba9876543210", pid=dead_pid(), **{field: "other"})
    assert [r["state"] for r in records.records()] == [origin.ELSEWHERE]
    cleaned(capsys)
    assert os.path.exists(path) and os.path.isdir(folder)


def test_a_record_that_cannot_tell_its_origin_is_left_alone(state, tmp_path, capsys):
    # What an older cmlcluster wrote: a host and a pid, nothing more.
    path, folder = write_record(state, tmp_path, "a1b2c3", pid=dead_pid())
    record = json.loads(open(path).read())
    del record["origin"]
    open(path, "w").write(json.dumps(record))
    assert [r["state"] for r in records.records()] == [origin.ELSEWHERE]
    cleaned(capsys)
    assert os.path.exists(path) and os.path.isdir(folder)


def test_a_pid_that_runs_another_process_is_gone(state, tmp_path, capsys):
    # This test's own pid runs, but it is not the process that started the session: the pid was reused.
    path, folder = write_record(state, tmp_path, "00000000deadbeef", start="1")
    assert [r["state"] for r in records.records()] == [origin.GONE]
    out = cleaned(capsys)
    assert f"session 00000000deadbeef (pid {os.getpid()} is gone): ended folder {folder}" in out, out
    assert not os.path.exists(path) and not os.path.exists(folder)


def test_a_session_whose_process_runs_is_alive(state, tmp_path, capsys):
    path, folder = write_record(state, tmp_path, "1111111111111111")
    assert [r["state"] for r in records.records()] == [origin.ALIVE]
    assert "nothing to clean up" in cleaned(capsys)
    assert os.path.exists(path) and os.path.isdir(folder)


def test_a_session_whose_controller_answers_is_left_alone(state, tmp_path, capsys):
    with socket.create_server(("127.0.0.1", 0)) as controller:
        address = f"127.0.0.1:{controller.getsockname()[1]}"
        path, folder = write_record(state, tmp_path, "2222222222222222", controller=address, pid=dead_pid())
        assert [r["state"] for r in records.records()] == [origin.ANSWERING]
        out = cleaned(capsys)
        assert f"its controller at {address} answers" in out, out
        assert os.path.exists(path) and os.path.isdir(folder)
    # Once nothing answers there, the session is gone.
    assert [r["state"] for r in records.records()] == [origin.GONE]
    cleaned(capsys)
    assert not os.path.exists(path) and not os.path.exists(folder)


def test_controller_address_reads_ipyparallel_connection_info():
    assert origin.controller_address(json.dumps({"location": "10.0.0.5", "registration": 4321})) == "10.0.0.5:4321"
    assert origin.controller_address(json.dumps({"location": "fd00::1", "registration": 80})) == "[fd00::1]:80"
    assert origin.controller_address("") == origin.controller_address("{}") == ""
    assert not origin.answers("") and not origin.answers("nonsense")


def test_a_session_s_record_says_which_process_it_is(state):
    with Session(FakeBackend([FakeWorker(run_time=60)]), echo=False) as s:
        s.await_workers(s.launch_workers(1, cpu=0.5, memory=0.5), wait_for_completion=False, timeout_seconds=30)
        [record] = records.records()
        assert record["id"] == s.id and record["state"] == origin.ALIVE
        assert record["origin"] == origin.this_process().as_strings()
    assert records.records() == []


def test_a_record_names_each_worker_as_the_views_do_and_keeps_what_it_asked_for(state):
    import time

    from cmlcluster.events import JobChanged, Member

    with Session(FakeBackend([FakeWorker(run_time=60), FakeWorker(run_time=60)]), echo=False) as s:
        ps, plain = s.launch_workers(2, cpu=0.5, memory=1.5, name="trainer")
        s.await_workers([ps, plain], wait_for_completion=False, timeout_seconds=30)
        s.publish(JobChanged("TensorFlow cluster", "started", (Member(ps["id"], "ps", 0),)))
        s.drain()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            [record] = records.records()
            workers = {w["id"]: w for w in record["workers"]}
            if workers.get(ps["id"], {}).get("label") == "ps 0":
                break
            time.sleep(0.05)
        assert workers[ps["id"]]["label"] == "ps 0"  # the job's name for it, as the widget's table says
        assert workers[plain["id"]]["label"] == f"w{plain['id'].rpartition('-')[2]}"
        assert {k: workers[plain["id"]][k] for k in ("cpu", "memory", "nvidia_gpu", "name")} == {
            "cpu": 0.5,
            "memory": 1.5,
            "nvidia_gpu": 0,
            "name": "trainer",
        }
        logs = s.log_folder
        assert logs
    # Kept once it closed: the panel names its workers as it did while they ran, not "w0" for "ps 0".
    summary = records.session_summary.read(logs)
    assert summary is not None and summary["ended"] is not None
    assert {w["id"]: w["label"] for w in summary["workers"]} == {
        ps["id"]: "ps 0",
        plain["id"]: f"w{plain['id'].rpartition('-')[2]}",
    }
    from cmlcluster.lab import sessions

    [kept] = [k for k in sessions.snapshot()["kept"] if k["id"] == s.id]
    assert {w["id"]: w["label"] for w in kept["workers"]} == {w["id"]: w["label"] for w in summary["workers"]}


def test_one_name_per_worker():
    from cmlcluster.worker_env import worker_label

    assert worker_label("0123456789abcdef-3") == "w3"
    assert worker_label("0123456789abcdef-3", role="ps", index=0) == "ps 0"
    assert worker_label("0123456789abcdef-3", "node 1", role="ps", index=0) == "node 1"  # the name kept wins
    assert worker_label("not-an-id") == "not-an-id" and worker_label("0123456789abcdef-3", "") == "w3"


# ---------------------------------------------------------------- the state folder


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=oct)
def test_a_state_folder_others_may_write_is_refused_before_anything_is_read(state, tmp_path, capsys, mode):
    path, folder = write_record(state, tmp_path, "00000000deadbeef", start="1")  # gone: cleanup would end it
    os.chmod(state, mode)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(state))} is writable by others .*chmod 700 "):
        records.records()
    assert main(["cleanup"]) == 2
    assert f"chmod 700 {state}" in capsys.readouterr().err
    assert os.path.exists(path) and os.path.isdir(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_a_state_folder_of_another_user_is_refused(state, tmp_path, capsys):
    path, folder = write_record(state, tmp_path, "00000000deadbeef", start="1")
    os.chown(state, os.geteuid() + 4242, -1)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(state))} belongs to uid {os.geteuid() + 4242}.*chown"):
        records.records()
    assert main(["list"]) == 2
    assert "CMLCLUSTER_STATE_DIR" in capsys.readouterr().err
    assert os.path.exists(path) and os.path.isdir(folder)


def test_the_state_folder_is_made_private(state):
    records.folder()
    assert stat.S_IMODE(os.stat(state).st_mode) & 0o077 == 0


# ---------------------------------------------------------------- session ids in shared names


def test_session_ids_have_64_bits_and_fit_every_shared_name():
    from cmlcluster.backends.kubernetes import names

    with Session(FakeBackend([]), echo=False) as s:
        assert re.fullmatch(r"[0-9a-f]{16}", s.id), s.id  # 64 bits: no two sessions on a host or cluster collide
    worker = f"{s.id}-1023"
    # Valid as they are: nothing is cut or hashed, so the names read as the ids users see.
    assert names.secret_name(s.id) == f"cmlcluster-{s.id}"
    assert names.pod_name(worker) == f"cmlcluster-{worker}"
    assert names.session_labels(s.id)[names.SESSION_LABEL] == s.id
    assert names.worker_labels(s.id, worker)[names.WORKER_LABEL] == worker


# ---------------------------------------------------------------- what backends leave: containers, Secrets


class Listed:
    """What the Docker SDK and the Kubernetes client return for one object, with what was done to it."""

    def __init__(self, name, labels=None, annotations=None, data=None):
        self.name, self.labels, self.removed = name, labels or {}, False
        self.metadata = type("Meta", (), {"name": name, "labels": self.labels, "annotations": annotations or {}})
        self.data = data

    def remove(self, force):
        self.removed = True


def origins(controller=""):
    """Per kind of session, what its origin says: ("gone" is the only one cleanup may end)."""
    mine = origin.this_process().as_strings()
    other_ns = str(int(mine["pidns"] or 0) + 1)
    return {
        "gone": {**mine, "pid": str(dead_pid())},
        "answering": {**mine, "pid": str(dead_pid())},
        "other-namespace": {**mine, "pid": str(dead_pid()), "pidns": other_ns},
        "reused-pid": {**mine, "start": "1"},
        "alive": mine,
        "older": {"host": mine["host"], "pid": str(dead_pid())},  # an older cmlcluster's: host and pid only
    }


def test_docker_cleanup_removes_the_containers_of_gone_sessions_only(monkeypatch):
    from cmlcluster.backends.docker import engine as docker_engine

    monkeypatch.delenv("CMLCLUSTER_RUN_TAG", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as controller:
        answering = f"127.0.0.1:{controller.getsockname()[1]}"
        containers = [
            Listed(
                f"cmlcluster-{kind}-0",
                {
                    "cmlcluster.session": kind,
                    **{f"cmlcluster.{k}": v for k, v in where.items()},
                    "cmlcluster.controller": answering if kind == "answering" else "",
                },
            )
            for kind, where in origins().items()
        ]
        client = type("Client", (), {})()
        client.containers = type("Containers", (), {"list": lambda self, **_: containers})()
        assert docker_engine.remove_orphans(client) == ["cmlcluster-gone-0", "cmlcluster-reused-pid-0"]
    assert [c.name for c in containers if c.removed] == ["cmlcluster-gone-0", "cmlcluster-reused-pid-0"]


def test_kubernetes_cleanup_deletes_the_secrets_of_gone_sessions_only():
    from base64 import b64encode

    from cmlcluster.backends.kubernetes import names, orphans
    from cmlcluster.backends.kubernetes.manifests import CONNECTION_KEY

    def connection(address):
        ip, port = address.rsplit(":", 1)
        info = json.dumps({"location": ip, "registration": int(port), "key": "k"})
        return {CONNECTION_KEY: b64encode(info.encode()).decode()}

    with socket.create_server(("127.0.0.1", 0)) as controller:
        answering = f"127.0.0.1:{controller.getsockname()[1]}"
        silent = socket.create_server(("127.0.0.1", 0))
        silent_address = f"127.0.0.1:{silent.getsockname()[1]}"
        silent.close()  # a port nothing listens on
        secrets = [
            Listed(
                f"cmlcluster-{kind}",
                {names.SESSION_LABEL: kind},
                {f"cmlcluster.io/{k}": v for k, v in where.items()},
                connection(answering if kind == "answering" else silent_address),
            )
            for kind, where in origins().items()
        ]
        pods = {s.name: Listed(f"{s.name}-0") for s in secrets}
        deleted = []

        class Core:
            def list_namespaced_secret(self, namespace, **_):
                return type("List", (), {"items": secrets})

            def list_namespaced_pod(self, namespace, label_selector, **_):
                kind = label_selector.rpartition("=")[2]
                return type("List", (), {"items": [pods[f"cmlcluster-{kind}"]]})

            def delete_namespaced_secret(self, name, namespace):
                deleted.append(name)

        ended = orphans.delete_orphans(Core(), "team", deleted.append, dry_run=False)
    assert ended == [
        "team/cmlcluster-gone-0",
        "team/cmlcluster-gone",
        *["team/cmlcluster-reused-pid-0"],
        "team/cmlcluster-reused-pid",
    ]
    assert deleted == ["cmlcluster-gone-0", "cmlcluster-gone", "cmlcluster-reused-pid-0", "cmlcluster-reused-pid"]


def test_a_launch_of_many_workers_rewrites_the_record_once_per_run_of_changes_not_once_per_change(state, monkeypatch):
    writes = []
    write = records.Recorder._write
    monkeypatch.setattr(records.Recorder, "_write", lambda self: (writes.append(1), write(self)))
    with Session(FakeBackend(lambda i: FakeWorker()), echo=False) as s:
        ready = s.await_workers(s.launch_workers(300, cpu=0.1, memory=0.1), wait_for_completion=False)
        assert len(ready["workers"]) == 300
        changes = 2 * 300  # each worker's scheduling and running, at least
        assert len(writes) < changes / 5, len(writes)
        # What `cmlcluster list` reads is current once the call has returned.
        with open(os.path.join(records.folder(), f"{s.id}.json")) as f:
            assert {w["status"] for w in json.load(f)["workers"]} == {"running"}


def test_resource_samples_of_many_workers_rewrite_the_record_less_often_than_those_of_few(state, monkeypatch):
    # Each write is every worker's record: at 1,024 workers sampling, once a second took 7 % of a core of the
    # notebook's process (bench/printing_model.py). Past USAGE_WRITE_WORKERS workers the interval grows.
    import time

    from cmlcluster.events import ResourceUse

    writes = []
    write = records.Recorder._write
    monkeypatch.setattr(records.Recorder, "_write", lambda self: (writes.append(time.monotonic()), write(self)))
    with Session(FakeBackend(lambda i: FakeWorker()), echo=False) as s:
        n = 4 * records.USAGE_WRITE_WORKERS  # a write every 4 USAGE_WRITE_SECONDS
        ready = s.await_workers(s.launch_workers(n, cpu=0.1, memory=0.1), wait_for_completion=False)
        ids = [w["id"] for w in ready["workers"]]
        writes.clear()
        end = time.monotonic() + 3 * records.USAGE_WRITE_SECONDS
        while time.monotonic() < end:  # every worker's sample, ten times a second
            for worker_id in ids:
                s.publish(ResourceUse(worker_id, cpu_percent=50.0, memory_bytes=2**20, memory_limit_bytes=None))
            s.drain()
            time.sleep(0.1)
        assert len(writes) <= 1, f"{len(writes)} writes in 3 s"  # 3 at one a second
        s.drain()
        with open(os.path.join(records.folder(), f"{s.id}.json")) as f:
            assert {w["status"] for w in json.load(f)["workers"]} == {"running"}
