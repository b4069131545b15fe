"""The SSH-hosts backend on real hosts: containers with IPs of their own running key-only sshd, logged
into as a non-root user, that see none of the session's files (sshhosts.py). The shared worker-API,
TensorFlow and Horovod tests run on them too (conftest.py's `backend` fixture); these are the
SSH-only ones: placement, host keys, preflight, a host that drops, the environment rule, and a
killed session. After each, conftest checks every host for a process or temp folder left."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness.fixtures import ssh_backend
from harness.leaks import leftovers_on
from harness.sshhosts import start_hosts

from cmlcluster import ConfigError, Session
from cmlcluster.backends.ssh.backend import SSHBackend, parse_hosts

pytestmark = pytest.mark.integration


def up(session, n, **kwargs):
    workers = session.launch_workers(n, cpu=0.2, memory=0.5, **kwargs)
    ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
    assert ready["failures"] == [], ready["failures"]
    return ready["workers"]


def test_workers_fill_hosts_by_free_slots_as_a_non_root_user_and_too_many_are_refused(ssh_hosts):
    with Session(ssh_backend(ssh_hosts, slots=2), echo=False) as s:
        workers = up(s, 5)
        per_host = Counter(w["ip_address"] for w in workers)
        assert sorted(per_host.values()) == [1, 2, 2] and set(per_host) == {h.ip for h in ssh_hosts.hosts}
        assert {s.call(w, "getpass:getuser") for w in workers} == {"alice"}
        # Workers that share a host are processes of their own there.
        assert len({(w["ip_address"], s.call(w, "os:getpid")) for w in workers}) == 5

        with pytest.raises(ConfigError, match=r"n=2 workers do not fit on the hosts \(free now: .*: 1 slots") as no:
            s.launch_workers(2, cpu=0.2, memory=0.5)
        assert "0 slots" in str(no.value)
        with pytest.raises(ConfigError, match=r"n=1 workers with 1 GPUs each do not fit"):
            s.launch_workers(1, cpu=0.2, memory=0.5, nvidia_gpu=1)
        assert len(s.list_workers()) == 5  # nothing more started


def test_workers_reported_finished_have_given_their_slots_back(ssh_hosts):
    # Two hosts of 2 slots: 4 workers run a program to its end, and at once 4 more start. A worker's
    # slot comes back when its ssh process exits, after its program ended: await_workers reports it
    # finished only then, so the last one to finish does not hold its slot against the next launch.
    two = dataclasses.replace(ssh_hosts, hosts=ssh_hosts.hosts[:2])
    with Session(ssh_backend(two, slots=2), echo=False) as s:
        first = s.launch_workers(4, cpu=0.2, memory=0.5, code="print('done')")
        done = s.await_workers(first, wait_for_completion=True, timeout_seconds=60)
        assert [w["status"] for w in done["workers"]] == ["succeeded"] * 4, done["failures"]
        workers = up(s, 4)  # refused while one held its slot: "free now: ...: 2 slots, ...: 1 slots"
        assert sorted(Counter(w["ip_address"] for w in workers).values()) == [2, 2]


def test_only_env_and_cmlclusters_own_variables_reach_a_worker_on_another_machine(ssh_hosts, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "notebook-secret")
    with Session(ssh_backend(ssh_hosts), echo=False) as s:
        [w] = up(s, 1, env={"MODEL": "resnet"})
        assert s.call(w, "os:getenv", "MODEL") == "resnet"
        assert s.call(w, "os:getenv", "AWS_SECRET_ACCESS_KEY") is None
        # The controller's key never reaches user code: it left the environment before any ran.
        assert s.call(w, "os:getenv", "CMLCLUSTER_CONNECTION") is None
        # On the session's own machine, workers inherit the session's environment (documented).
    with Session("local", echo=False) as s:
        [w] = up(s, 1)
        assert s.call(w, "os:getenv", "AWS_SECRET_ACCESS_KEY") == "notebook-secret"


def test_gpu_ids_per_host_go_to_the_workers_that_asked(ssh_hosts):
    first = ssh_hosts.hosts[0].ip
    with Session(ssh_backend(ssh_hosts, gpus={first: ["0", "1"]}), echo=False) as s:
        workers = up(s, 2, nvidia_gpu=1)
        assert {w["ip_address"] for w in workers} == {first}  # the only host with GPUs
        seen = sorted(s.call(w, "os:getenv", "CUDA_VISIBLE_DEVICES") for w in workers)
        assert seen == ["0", "1"]
        [plain] = up(s, 1)
        assert s.call(plain, "os:getenv", "CUDA_VISIBLE_DEVICES") == ""


def test_a_host_that_drops_fails_its_workers_while_the_others_carry_on():
    with start_hosts(2) as hosts:
        # A host gone is a silence, and a short silence_timeout (3 s) makes ssh give up on it within 6 s.
        with Session(ssh_backend(hosts, slots=1), echo=False, silence_timeout=3) as s:
            # 12 s of steps: twice the 6 s within which ssh gives up on the lost host (about 5 s here).
            code = "import time\nfor i in range(48):\n    print('step', i, flush=True)\n    time.sleep(0.25)\n"
            workers = s.launch_workers(2, cpu=0.2, memory=0.5, code=code)
            deadline = time.monotonic() + 60
            while any("step 1" not in s.output(w) for w in workers):
                assert time.monotonic() < deadline, [s.output(w) for w in workers]
                time.sleep(0.1)
            records = {w["id"]: r for w in workers for r in s.list_workers() if r["id"] == w["id"]}
            victim = next(w for w in workers if records[w["id"]]["ip_address"] == hosts.hosts[0].ip)
            other = next(w for w in workers if w is not victim)
            hosts.hosts[0].kill()
            [failure] = s.await_workers([victim], timeout_seconds=30)["failures"]
            # Reported while the other worker still prints its 12 s of steps: by the lost connection
            # (ssh's keepalives), not by the controller's heartbeat.
            assert "step 47" not in s.output(other), s.output(other)
            assert failure["status"] == "failed", failure
            assert f"lost the SSH connection to {hosts.hosts[0].ip}" in failure["message"]
            # The other host's worker was not disturbed: it finishes its program.
            assert s.await_workers([other], timeout_seconds=60)["failures"] == []
            assert "step 47" in s.output(other)
        assert leftovers_on(SimpleNamespace(hosts=hosts.hosts[1:])) == {}  # the dropped one is gone


def test_unknown_or_changed_host_keys_are_refused_and_trust_on_first_use_is_asked_for(ssh_hosts, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with Session(ssh_backend(ssh_hosts, known_hosts=str(empty)), echo=False) as s:
        with pytest.raises(ConfigError, match=r"(?s)3 of 3 SSH hosts cannot run workers.*host key is unknown"):
            s.launch_workers(1, cpu=0.2, memory=0.5)
        assert s.list_workers() == []

    # A host presenting another key than the recorded one: refused even with trust-on-first-use.
    lines = Path(ssh_hosts.known_hosts).read_text().splitlines()
    other = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True
    )
    assert other.returncode == 0
    impostor = (tmp_path / "impostor.pub").read_text().split()
    changed = tmp_path / "known_hosts_changed"
    changed.write_text("\n".join([f"{ssh_hosts.hosts[0].ip} {impostor[0]} {impostor[1]}", *lines[1:]]) + "\n")
    with Session(ssh_backend(ssh_hosts, known_hosts=str(changed), trust_on_first_use=True), echo=False) as s:
        with pytest.raises(ConfigError, match=rf"(?s)1 of 3 SSH hosts.*\n  {ssh_hosts.hosts[0].ip}: its host key"):
            s.launch_workers(1, cpu=0.2, memory=0.5)

    # Asked for by name, a host seen for the first time is trusted, and its key recorded.
    with Session(ssh_backend(ssh_hosts, known_hosts=str(empty), trust_on_first_use=True), echo=False) as s:
        up(s, 1)
    assert len(empty.read_text().splitlines()) == 3


def test_a_host_without_cmlcluster_is_refused_before_anything_starts(ssh_hosts):
    with start_hosts(1, with_cmlcluster=False) as bare:
        known = Path(ssh_hosts.known_hosts).read_text() + Path(bare.known_hosts).read_text()
        both = Path(bare.known_hosts).with_name("both_known_hosts")
        both.write_text(known)
        backend = SSHBackend(
            [ssh_hosts.hosts[0].ip, bare.hosts[0].ip],
            user="alice",
            identity=ssh_hosts.identity_file,
            known_hosts=str(both),
            python=ssh_hosts.python,
            ssh_options=[f"IdentityFile={bare.identity_file}"],  # each start_hosts() makes a key of its own
        )
        with Session(backend, echo=False) as s:
            with pytest.raises(ConfigError) as refused:
                s.launch_workers(1, cpu=0.2, memory=0.5)
            message = str(refused.value)
            assert f"  {bare.hosts[0].ip}: " in message
            assert "cmlcluster is not installed" in message and "pip install" in message
            assert ssh_hosts.hosts[0].ip not in message.split("\n", 1)[1]
            assert s.list_workers() == []
        assert leftovers_on(bare) == {}


def test_a_killed_session_leaves_nothing_on_any_host(ssh_hosts):
    backend = {
        "hosts": [h.ip for h in ssh_hosts.hosts],
        "user": ssh_hosts.user,
        "identity": ssh_hosts.identity_file,
        "known_hosts": ssh_hosts.known_hosts,
        "python": ssh_hosts.python,
    }
    program = f"""
import time
from cmlcluster import Session
s = Session("ssh", echo=False, **{backend!r})
workers = s.launch_workers(3, cpu=0.2, memory=0.5, code="import time; time.sleep(600)")
assert s.await_workers(workers, wait_for_completion=False, timeout_seconds=60)["failures"] == []
print("ready", flush=True)
time.sleep(600)
"""
    process = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        assert len(leftovers_on(ssh_hosts)) == 3  # a worker on each host
        process.kill()
        process.wait()
        killed = time.monotonic()
        while leftovers_on(ssh_hosts) and time.monotonic() - killed < 15:
            time.sleep(0.2)
        assert leftovers_on(ssh_hosts) == {}
    finally:
        process.kill()


@pytest.mark.parametrize(
    ("hosts", "hostfile", "expected"),
    [
        (["10.0.0.5", "10.0.0.6:2"], None, [("10.0.0.5", 1), ("10.0.0.6", 2)]),
        ("10.0.0.5:4,10.0.0.6", None, [("10.0.0.5", 4), ("10.0.0.6", 1)]),
        (
            None,
            "# cluster\nnode1 slots=4\nnode2 slots=2  # spare\n\nnode3\n",
            [("node1", 4), ("node2", 2), ("node3", 1)],
        ),
    ],
)
def test_hosts_and_machinefiles_are_read_like_horovodrun_and_mpirun(hosts, hostfile, expected, tmp_path):
    if hostfile is not None:
        (tmp_path / "machinefile").write_text(hostfile)
        assert parse_hosts(hostfile=str(tmp_path / "machinefile")) == expected
    else:
        assert parse_hosts(hosts) == expected


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"hosts": ["a:0"]}, "'a:0': a host needs 1 or more slots"),
        ({"hosts": ["a", "a:2"]}, "listed twice"),
        ({"hosts": ["a slots=2:3"]}, "write 'host', 'host:slots' or 'host slots=N'"),
        ({"hosts": []}, "no hosts"),
        ({}, "one of the two"),
        ({"hostfile": "/no/such/machinefile"}, "hostfile='/no/such/machinefile'"),
        ({"hosts": ["a"], "port": 0}, "port=0"),
        ({"hosts": ["a"], "identity": "/no/key"}, "identity='/no/key': no such file"),
        ({"hosts": ["a"], "gpus": {"b": ["0"]}}, r"gpus= names \['b'\]"),
    ],
)
def test_bad_backend_options_name_the_value(kwargs, names, monkeypatch):
    monkeypatch.delenv("CMLCLUSTER_SSH_HOSTFILE", raising=False)
    with pytest.raises(ConfigError, match=names):
        SSHBackend(**kwargs)


def test_the_environment_can_name_the_machinefile(tmp_path, monkeypatch):
    (tmp_path / "machinefile").write_text("node1 slots=2\n")
    monkeypatch.setenv("CMLCLUSTER_SSH_HOSTFILE", str(tmp_path / "machinefile"))
    backend = SSHBackend(user="alice")  # as use_backend("ssh") or %horovod --backend ssh make it
    assert [(h.address, h.slots) for h in backend.hosts] == [("node1", 2)]


def test_the_working_folder_travels_on_request_and_is_capped(ssh_hosts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("x,y\n1,2\n")
    (tmp_path / "job.py").write_text("print(open('data/train.csv').read().splitlines()[1])\n")
    with Session(ssh_backend(ssh_hosts), echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.2, memory=0.5, script="job.py", ship_working_folder=True)
        assert s.await_workers([w], timeout_seconds=60)["failures"] == []
        assert s.output(w) == "1,2"
        # A worker without a program has its copy before it counts as running.
        [idle] = up(s, 1, ship_working_folder=True)
        assert sorted(s.call(idle, "os:listdir", ".")) == ["data", "job.py"]
        # Without asking, only the script travels.
        [bare] = s.launch_workers(1, cpu=0.2, memory=0.5, script="job.py")
        [failure] = s.await_workers([bare], timeout_seconds=60)["failures"]
        assert "No such file or directory: 'data/train.csv'" in failure["message"]

        (tmp_path / "data" / "big.bin").write_bytes(os.urandom(200_000))
        monkeypatch.setenv("CMLCLUSTER_SHIP_LIMIT_MB", "0.1")
        with pytest.raises(ConfigError, match=rf"the working folder {tmp_path} holds more than 0.1 MB"):
            s.launch_workers(1, cpu=0.2, memory=0.5, script="job.py", ship_working_folder=True)
        assert len(s.list_workers()) == 3  # refused before anything started


def test_tensorflow_tasks_that_share_a_host_get_ports_of_their_own(ssh_hosts):
    from cmlcluster import start_cluster

    with Session(ssh_backend(ssh_hosts), echo=False) as s:
        # Four tasks on three hosts: two share one, each server listening (start_cluster waits for it).
        with start_cluster(n_workers=3, n_ps=1, cpu=0.5, memory=1, coordinator=False, session=s) as cluster:
            addresses = cluster.cluster_spec["ps"] + cluster.cluster_spec["worker"]
            by_host = Counter(a.rpartition(":")[0] for a in addresses)
            assert sorted(by_host.values()) == [1, 1, 2]
            shared = next(h for h, n in by_host.items() if n == 2)
            assert len({a for a in addresses if a.startswith(f"{shared}:")}) == 2  # a free port each, there
