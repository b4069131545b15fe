"""Least privilege and isolation of Docker workers (issue 23): the notebook user's uid, no capabilities
(as root, only sshd's), no new privileges, a pids limit, the session's keys out of the container's
environment, and a network per session that no other session's container reaches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import docker
import ipyparallel as ipp
import pytest
from harness.docker_window import refused_unless_in_dockers_window
from harness.fixtures import DOCKER_TEST_IMAGE

from cmlcluster import ConfigError, Session
from cmlcluster.backends.docker import engine as docker_engine
from cmlcluster.backends.docker import gateway as docker_gateway
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.wire import CONNECTION_ENV, CONNECTION_FILE_ENV

pytestmark = pytest.mark.integration

# CAP_SETGID (6), CAP_SETUID (7), CAP_SYS_CHROOT (18): a root worker's only ones, for sshd.
ROOT_CAPABILITIES = (1 << 6) | (1 << 7) | (1 << 18)


@pytest.fixture
def client():
    c = docker.from_env()
    yield c
    c.close()


def containers_of(client, session_id):
    return client.containers.list(filters={"label": f"cmlcluster.session={session_id}"}, ignore_removed=True)


def networks_of(client, session_id):
    return client.networks.list(filters={"label": f"cmlcluster.session={session_id}"})


@ipp.interactive
def inside():
    """Runs on a worker: what it is allowed, and where its connection info is."""
    import os as _os

    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
    pids_max = next(
        open(path).read().strip()
        for path in ("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids.max")
        if _os.path.exists(path)
    )
    home = _os.environ.get("HOME", "")
    with open(_os.path.join(home, "written"), "w") as f:  # HOME is writable
        f.write("x")
    folder = "/tmp/cmlcluster-" + _os.environ["CDSW_ENGINE_ID"]
    connection = _os.stat(folder + "/connection.json")
    return {
        "uid": _os.getuid(),
        "gid": _os.getgid(),
        "CapEff": int(status["CapEff"], 16),
        "NoNewPrivs": int(status["NoNewPrivs"]),
        "pids.max": pids_max,
        "home": home,
        "connection": (connection.st_uid, connection.st_gid, connection.st_mode & 0o777),
        "environ": sorted(_os.environ),
    }


@ipp.interactive
def write(path, text):
    with open(path, "w") as f:
        f.write(text)


@ipp.interactive
def threads_until_refused(most):
    """Runs on a worker: start sleeping threads until the kernel refuses one; how many started."""
    import threading as _threading

    stop, started = _threading.Event(), 0
    try:
        for _ in range(most):
            _threading.Thread(target=stop.wait, daemon=True).start()
            started += 1
    except RuntimeError:  # "can't start new thread": clone() got EAGAIN
        pass
    stop.set()
    return started


@ipp.interactive
def listen():
    """Runs on a worker: answer "hello" to each connection on every interface, in the background; return
    the port."""
    import socket as _socket
    import threading as _threading

    server = _socket.create_server(("0.0.0.0", 0))

    def answer():
        while True:
            connection, _ = server.accept()
            connection.sendall(b"hello")
            connection.close()

    _threading.Thread(target=answer, daemon=True).start()
    return server.getsockname()[1]


@ipp.interactive
def dial(address, port):
    """Runs on a worker: what a TCP connection to address:port gets, or why it failed."""
    import socket as _socket

    try:
        with _socket.create_connection((address, port), timeout=3) as connection:
            return connection.recv(100).decode()
    except OSError as e:
        return f"failed: {type(e).__name__}"


def test_a_worker_runs_as_the_users_uid_and_its_files_are_the_users(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # the container's uid is not this process's: let it write
    # mount_cwd=False: the checkout, the tests' working folder, may be private to root (a mktemp -d clone).
    backend = DockerBackend(
        image=DOCKER_TEST_IMAGE, host_python=True, user="1234:1234", volumes={str(out): "/out"}, mount_cwd=False
    )
    with Session(backend, echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5)
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        found = s.client[w["engine_id"]].apply_sync(inside)
        s.client[w["engine_id"]].apply_sync(write, "/out/checkpoint", "weights")
    assert (found["uid"], found["gid"]) == (1234, 1234)
    assert found["CapEff"] == 0 and found["NoNewPrivs"] == 1
    assert found["home"] == f"/tmp/cmlcluster-{w['id']}/home"
    assert found["connection"] == (1234, 1234, 0o600)
    written = (out / "checkpoint").stat()
    assert (written.st_uid, written.st_gid) == (1234, 1234)


def test_a_root_worker_keeps_only_sshds_capabilities_and_no_new_privileges(client, tmp_path):
    # This process's uid (the default user=) is root here, as in CI.
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, user="0:0")
    with Session(backend, echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5)
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        found = s.client[w["engine_id"]].apply_sync(inside)
        [container] = containers_of(client, s.id)
        host = container.attrs["HostConfig"]
    assert found["uid"] == 0 and found["connection"] == (0, 0, 0o600)
    assert found["CapEff"] == ROOT_CAPABILITIES, hex(found["CapEff"])
    assert found["NoNewPrivs"] == 1
    assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == ["SETGID", "SETUID", "SYS_CHROOT"]
    assert found["pids.max"] == "4096" and host["PidsLimit"] == 4096


def test_the_pids_limit_is_in_effect():
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, pids_limit=64)
    with Session(backend, echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5)
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        assert s.client[w["engine_id"]].apply_sync(inside)["pids.max"] == "64"
        started = s.client[w["engine_id"]].apply_sync(threads_until_refused, 200)
    assert 0 < started < 64  # the agent's own threads count too
    with pytest.raises(ConfigError, match=r"pids_limit=0: give the most processes per worker"):
        DockerBackend(pids_limit=0)
    with pytest.raises(ConfigError, match=r"user='alice': give numbers, 'uid:gid'"):
        DockerBackend(user="alice")


def test_the_sessions_keys_are_not_in_the_containers_environment(client):
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5)
        s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
        key = s.client.session.key.decode()  # the controller's: the engines' and the client's alike
        [container] = containers_of(client, s.id)
        env = container.attrs["Config"]["Env"]
        labels = container.labels
        environ = s.client[w["engine_id"]].apply_sync(inside)["environ"]
    assert key and not any(key in variable for variable in env), env
    assert not any(v.startswith(f"{CONNECTION_ENV}=") for v in env)
    assert f"{CONNECTION_FILE_ENV}=/tmp/cmlcluster-{w['id']}/connection.json" in env
    assert CONNECTION_ENV not in environ and CONNECTION_FILE_ENV not in environ  # the agent took them
    assert labels["cmlcluster.controller"].startswith(f"{s.controller_ip}:")  # cleanup still asks the controller


def test_each_session_has_its_own_network_that_others_cannot_reach_and_it_goes_with_the_session(client):
    with (
        Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as a,
        Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as b,
    ):
        [wa] = a.launch_workers(1, cpu=0.5, memory=0.5)
        [wb] = b.launch_workers(1, cpu=0.5, memory=0.5)
        [ra] = a.await_workers([wa], wait_for_completion=False, timeout_seconds=60)["workers"]
        b.await_workers([wb], wait_for_completion=False, timeout_seconds=60)
        [network_a], [network_b] = networks_of(client, a.id), networks_of(client, b.id)
        assert (network_a.name, network_b.name) == (f"cmlcluster-{a.id}", f"cmlcluster-{b.id}")
        [container_a] = containers_of(client, a.id)
        assert list(container_a.attrs["NetworkSettings"]["Networks"]) == [network_a.name]
        # A's worker listens on every interface; B's cannot connect to it. (The host, where both
        # sessions' controllers are, reaches both networks: that is how workers reach their session.)
        port = a.client[wa["engine_id"]].apply_sync(listen)
        across = refused_unless_in_dockers_window(
            client,
            lambda: b.client[wb["engine_id"]].apply_sync(dial, ra["ip_address"], port),
            lambda got: not got.startswith("failed:"),
        )
        assert across.startswith("failed:"), across
        assert a.client[wa["engine_id"]].apply_sync(dial, ra["ip_address"], port) == "hello"  # it did listen
    assert networks_of(client, a.id) == [] and networks_of(client, b.id) == []


def answer_hello(server):
    """Answer "hello" to each connection until the server is shut down."""
    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        connection.sendall(b"hello")
        connection.close()


def test_no_container_of_another_network_reaches_what_listens_on_the_sessions_gateway(client):
    """Docker keeps networks apart in FORWARD; the gateway is the host's own address, reached through
    INPUT: the session shuts it to every interface but its bridge (as root, which the suite runs as)."""
    assert docker_gateway.can_change_firewall(), "the suite runs as root with iptables (scripts/install.sh dev)"
    with (
        Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as a,
        Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as b,
    ):
        [wa] = a.launch_workers(1, cpu=0.5, memory=0.5)
        [wb] = b.launch_workers(1, cpu=0.5, memory=0.5)
        a.await_workers([wa], wait_for_completion=False, timeout_seconds=60)
        b.await_workers([wb], wait_for_completion=False, timeout_seconds=60)
        network = docker_engine.session_network_name(a.id)
        assert len(docker_gateway.rules(network)) == 1
        assert a.backend.capabilities().session_machine  # its engine runs here: this machine's users reach it
        # What the session's own servers would be: a listener of the test's on A's gateway only.
        with socket.create_server((a.controller_ip, 0)) as server:
            port = server.getsockname()[1]
            answering = threading.Thread(target=answer_hello, args=(server,), daemon=True)
            answering.start()
            try:
                assert b.client[wb["engine_id"]].apply_sync(dial, a.controller_ip, port).startswith("failed:")
                assert a.client[wa["engine_id"]].apply_sync(dial, a.controller_ip, port) == "hello"  # its own: yes
                with socket.create_connection((a.controller_ip, port), timeout=3) as here:  # the host: yes
                    assert here.recv(5) == b"hello"
            finally:
                server.shutdown(socket.SHUT_RDWR)  # wakes its accept()
                answering.join(timeout=5)
    assert docker_gateway.rules(network) == []  # the rule went with the network


def test_a_gateway_rule_whose_network_went_without_it_is_removed_by_cleanup():
    network = f"cmlcluster-test-{os.urandom(6).hex()}"  # a rule of the test's own, for a bridge that is gone
    assert docker_gateway.shut(network, "10.254.254.1", f"br-{os.urandom(6).hex()}")
    try:
        assert len(docker_gateway.rules(network)) == 1
        docker_engine.remove_orphan_networks(quiet=True)  # what `cmlcluster cleanup` runs
        assert docker_gateway.rules(network) == []
    finally:
        docker_gateway.reopen(network)


EXITING_SESSION = textwrap.dedent("""
    import cmlcluster as cdsw
    workers = cdsw.launch_workers(1, cpu=0.5, memory=0.5)
    assert cdsw.await_workers(workers, wait_for_completion=False, timeout_seconds=60)["workers"]
    print(cdsw.get_session().id, flush=True)
""")  # and the interpreter exits, with the session open: atexit closes it


def test_a_session_closed_as_the_interpreter_exits_stops_its_workers_and_removes_its_network(client):
    env = dict(os.environ, CMLCLUSTER_BACKEND="docker", CMLCLUSTER_DOCKER_IMAGE=DOCKER_TEST_IMAGE)
    env["CMLCLUSTER_DOCKER_HOST_PYTHON"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", EXITING_SESSION], env=env, stdout=subprocess.PIPE, text=True)
    session_id = proc.stdout.readline().strip()
    exiting = time.monotonic()
    assert proc.wait(timeout=60) == 0
    # Python's executors take no work once atexit runs: a close that needed them waited 35 s here,
    # and its network stayed.
    assert time.monotonic() - exiting < 15
    assert networks_of(client, session_id) == [] and containers_of(client, session_id) == []
    assert docker_gateway.rules(docker_engine.session_network_name(session_id)) == []


def test_a_shared_network_is_the_opt_out_and_is_kept(client):
    name = f"cmlcluster-shared-{os.getpid()}"
    try:
        with Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, network=name), echo=False) as s:
            [w] = s.launch_workers(1, cpu=0.5, memory=0.5)
            s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
            [container] = containers_of(client, s.id)
            assert list(container.attrs["NetworkSettings"]["Networks"]) == [name]
            assert networks_of(client, s.id) == []  # not the session's: cleanup never takes it
        assert client.networks.get(name).name == name
    finally:
        client.networks.get(name).remove()


def test_an_exhausted_address_pool_says_what_to_do():
    class Networks:
        def list(self, **_):
            return []

        def create(self, *_, **__):
            raise docker.errors.APIError(
                "500 Server Error",
                explanation="could not find an available, non-overlapping IPv4 address pool among the defaults "
                "to assign to the network",
            )

    for name in (socket.gethostname(), "an engine elsewhere"):  # the range chosen here, or by the engine
        engine = type("Client", (), {"networks": Networks(), "info": lambda self, name=name: {"Name": name}})()
        with pytest.raises(ConfigError, match=r"(?s)no free address range.*cmlcluster cleanup.*default-address-pools"):
            docker_engine.session_network(engine, "feed02")


def test_sessions_making_their_networks_at_once_each_get_a_range_of_their_own_that_takes_chosen_addresses(client):
    import concurrent.futures
    import ipaddress

    from cmlcluster.backends.docker import ranges as docker_ranges

    routes = docker_ranges.host_routes()  # before: the new networks' bridges add their own
    ids = [f"ranges{os.getpid()}x{i}" for i in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
            gateways = list(pool.map(lambda i: docker_engine.session_network(client, i), ids))
        configs = [client.networks.get(docker_engine.session_network_name(i)).attrs["IPAM"]["Config"] for i in ids]
        subnets = [ipaddress.ip_network(c[0]["Subnet"]) for c in configs]
        assert not [(a, b) for a in subnets for b in subnets if a is not b and a.overlaps(b)], subnets
        assert not [(s, r) for s in subnets for r in routes if s.overlaps(r)], (subnets, routes)
        assert gateways == [str(s[1]) for s in subnets]
        # What a lost TensorFlow task's replacement needs: a container at an address of one's choosing.
        chosen = str(subnets[0][7])
        container = client.api.create_container(
            DOCKER_TEST_IMAGE,  # empty: its programs are the host's /usr, as host_python's workers'
            ["/usr/bin/sleep", "60"],  # removed below once its address is read
            labels=docker_engine.session_labels(ids[0]),
            networking_config=client.api.create_networking_config(
                {docker_engine.session_network_name(ids[0]): client.api.create_endpoint_config(ipv4_address=chosen)}
            ),
            host_config=client.api.create_host_config(
                network_mode=docker_engine.session_network_name(ids[0]), binds={"/usr": {"bind": "/usr", "mode": "ro"}}
            ),
        )
        try:
            client.api.start(container)
            networks = client.api.inspect_container(container)["NetworkSettings"]["Networks"]
            assert networks[docker_engine.session_network_name(ids[0])]["IPAddress"] == chosen
        finally:
            client.api.remove_container(container, force=True)
    finally:
        for i in ids:
            docker_engine.remove_network(client, docker_engine.session_network_name(i))
