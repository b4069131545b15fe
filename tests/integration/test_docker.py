"""What only the docker backend has: containers with their own IPs, what is sent to Docker, container
deaths, teardown after a killed session, `cmlcluster cleanup`, and the errors users hit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import docker
import ipyparallel as ipp
import pytest
from harness.fixtures import DOCKER_TEST_IMAGE

from cmlcluster import ConfigError, Session, origin
from cmlcluster.backends.base import SessionContext, run_tag_labels
from cmlcluster.backends.docker import engine as docker_engine
from cmlcluster.backends.docker import gateway as docker_gateway
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.backends.docker.engine import remove_orphan_networks, remove_orphans

pytestmark = pytest.mark.integration


@pytest.fixture
def client():
    c = docker.from_env()
    yield c
    c.close()


@pytest.fixture
def docker_session(tmp_path_factory):
    shared = str(tmp_path_factory.getbasetemp())
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, volumes={shared: shared}), echo=False) as s:
        yield s


def containers_of(client, session_id):
    return client.containers.list(all=True, filters={"label": f"cmlcluster.session={session_id}"}, ignore_removed=True)


@ipp.interactive
def listen_once():
    """Runs on a worker: accept one connection on a free port in the background; return the port."""
    import socket as _socket
    import threading as _threading

    server = _socket.create_server(("0.0.0.0", 0))

    def answer():
        connection, peer = server.accept()
        connection.sendall(f"hello {peer[0]}".encode())
        connection.close()

    _threading.Thread(target=answer, daemon=True).start()
    return server.getsockname()[1]


@ipp.interactive
def read(path):
    with open(path) as f:
        return f.read()


@ipp.interactive
def dial(address, port):
    import socket as _socket

    with _socket.create_connection((address, port), timeout=10) as connection:
        return connection.recv(100).decode()


def test_containers_have_their_own_ips_and_reach_each_other(docker_session, client):
    workers = docker_session.launch_workers(2, cpu=0.5, memory=0.5)
    running = docker_session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)["workers"]
    a, b = (w["ip_address"] for w in running)
    assert a != b and not a.startswith("127.")
    # Docker agrees on the addresses, and the containers are labelled with their session and worker.
    found = {c.labels["cmlcluster.worker"]: c for c in containers_of(client, docker_session.id)}
    assert sorted(found) == sorted(w["id"] for w in workers)
    for w in running:
        networks = found[w["id"]].attrs["NetworkSettings"]["Networks"]
        assert networks[f"cmlcluster-{docker_session.id}"]["IPAddress"] == w["ip_address"]
    # Worker b talks to worker a by a's IP, and a sees b's IP as the peer.
    port = docker_session.client[workers[0]["engine_id"]].apply_sync(listen_once)
    assert docker_session.client[workers[1]["engine_id"]].apply_sync(dial, a, port) == f"hello {b}"
    docker_session.stop_workers()
    assert containers_of(client, docker_session.id) == []


def test_cpu_and_memory_requests_reach_docker(docker_session, client):
    [w] = docker_session.launch_workers(1, cpu=1.5, memory=0.75)
    docker_session.await_workers([w], wait_for_completion=False, timeout_seconds=60)
    [container] = containers_of(client, docker_session.id)
    host = container.attrs["HostConfig"]
    assert host["NanoCpus"] == 1_500_000_000
    assert host["Memory"] == 768 * 1024**2
    assert host["AutoRemove"] is True and host["Init"] is True
    # The container's own cgroup enforces the memory limit.
    limit = docker_session.client[w["engine_id"]].apply_sync(read, "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    assert int(limit) == 768 * 1024**2


def test_gpu_requests_are_device_requests_for_each_workers_own_gpus(client, tmp_path):
    # No GPU here: check what would be sent, and that Docker itself accepts and records it.
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, gpu_ids=["0", "1", "2", "3"])
    with Session(backend, echo=False) as s:
        asyncio.run(backend.attach(SessionContext(session_id=s.id, session_dir=str(tmp_path))))
        from cmlcluster.workers import Resources, WorkerSpec

        spec = WorkerSpec("w-0", 0, (sys.executable, "-m", "cmlcluster.agent"), {}, Resources(1, 1, 2), str(tmp_path))
        first, second = backend._gpus.take(2), backend._gpus.take(2)
        options = backend.container_options(spec, first)
        [request] = options["device_requests"]
        assert request["DeviceIDs"] == ["0", "1"] and request["Capabilities"] == [["gpu"]]
        assert backend.container_options(spec, second)["device_requests"][0]["DeviceIDs"] == ["2", "3"]
        try:
            created = client.containers.create(
                **{k: v for k, v in options.items() if k not in ("detach", "auto_remove")}
            )
            try:
                [recorded] = created.attrs["HostConfig"]["DeviceRequests"]
                assert recorded["DeviceIDs"] == ["0", "1"] and recorded["Capabilities"] == [["gpu"]]
            finally:
                created.remove(force=True)
        finally:
            asyncio.run(backend.close())  # the session network attach() made
        # Without known ids, the request is by count.
        by_count = DockerBackend(image=DOCKER_TEST_IMAGE, gpu_ids=[])
        asyncio.run(by_count.attach(SessionContext(session_id=f"{s.id}-by-count", session_dir=str(tmp_path))))
        try:
            assert by_count.container_options(spec, [])["device_requests"][0]["Count"] == 2
        finally:
            asyncio.run(by_count.close())
    # This engine has no GPU runtime: a GPU launch is refused before anything starts, saying why.
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as s:
        with pytest.raises(ConfigError, match=r"nvidia_gpu=1: this Docker engine has no GPU runtime.*nvidia-ctk"):
            s.launch_workers(1, cpu=1, memory=1, nvidia_gpu=1)
        assert s.list_workers() == [] and s.client is None


def test_more_cpu_or_memory_than_the_engine_has_is_refused_before_anything_starts(client):
    info = client.info()
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as s:
        with pytest.raises(
            ConfigError, match=rf"cpu={info['NCPU'] + 1}: Docker's engine \(.*\) has {info['NCPU']} CPU"
        ):
            s.launch_workers(1, cpu=info["NCPU"] + 1, memory=1)
        with pytest.raises(ConfigError, match=r"memory=100000: Docker's engine .* GB of memory in all"):
            s.launch_workers(1, cpu=1, memory=100000)
        assert s.list_workers() == [] and s.client is None  # not even the controller


def test_killed_container_fails_with_exit_code_and_output_tail(docker_session, client):
    [w] = docker_session.launch_workers(
        1, cpu=0.5, memory=0.5, code="print('epoch 1 done', flush=True)\nimport time\ntime.sleep(600)"
    )
    docker_session.await_workers([w], wait_for_completion=False, timeout_seconds=60)
    deadline = time.monotonic() + 30
    while "epoch 1 done" not in docker_session.output(w) and time.monotonic() < deadline:
        time.sleep(0.1)
    [container] = containers_of(client, docker_session.id)
    container.kill()  # SIGKILL to the container's init: everything in it dies
    [failure] = docker_session.await_workers([w], timeout_seconds=30)["failures"]
    assert failure["status"] == "failed"
    assert failure["exit_code"] == -9
    assert "epoch 1 done" in failure["message"]


SESSION_SCRIPT = textwrap.dedent("""
    import sys
    import cmlcluster as cdsw
    workers = cdsw.launch_workers(2, cpu=0.5, memory=0.5)
    result = cdsw.await_workers(workers, wait_for_completion=False, timeout_seconds=60)
    assert len(result["workers"]) == 2, result
    print(cdsw.get_session().id, flush=True)
    sys.stdin.read()
""")


def test_killed_session_process_leaves_no_container_nor_network_within_10_seconds(client):
    env = dict(os.environ, CMLCLUSTER_BACKEND="docker", CMLCLUSTER_DOCKER_IMAGE=DOCKER_TEST_IMAGE)
    env["CMLCLUSTER_DOCKER_HOST_PYTHON"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-c", SESSION_SCRIPT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    session_id = proc.stdout.readline().strip()
    assert session_id, "the session process printed nothing"
    assert len(containers_of(client, session_id)) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()

    def networks() -> list:
        return client.networks.list(filters={"label": f"cmlcluster.session={session_id}"})

    # The session's reaper (docker_reaper) sees its end, and removes its containers and its network.
    while (containers_of(client, session_id) or networks()) and time.monotonic() - killed_at < 10:
        time.sleep(0.2)
    assert containers_of(client, session_id) == [], "containers outlived their session by 10 s"
    assert networks() == [], "its network outlived the session by 10 s"
    # and its gateway's firewall rule (docker_gateway), which the reaper removes right after the network
    network = docker_engine.session_network_name(session_id)
    while docker_gateway.rules(network) and time.monotonic() - killed_at < 12:
        time.sleep(0.2)
    assert docker_gateway.rules(network) == []


def test_cleanup_removes_containers_and_networks_of_dead_sessions_only(client):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    # The run's tag: under one, `cmlcluster cleanup` looks only at its run's containers. The origin: this
    # process's (its host, boot, PID namespace, pid and start time), with the pid of a process gone for
    # the orphan; the other's is this very process, which runs.
    mine = {f"cmlcluster.{k}": v for k, v in origin.this_process().as_strings().items()}
    labels = {"cmlcluster.session": "feed00", **mine, **run_tag_labels()}
    orphan = client.containers.run(
        DOCKER_TEST_IMAGE,
        ["/usr/bin/sleep", "600"],
        detach=True,
        volumes=["/usr:/usr:ro"],
        labels={
            **labels,
            "cmlcluster.session": "feed01",
            "cmlcluster.worker": "feed01-0",
            "cmlcluster.pid": str(dead.pid),
        },
    )
    alive = client.containers.run(
        DOCKER_TEST_IMAGE,
        ["/usr/bin/sleep", "600"],
        detach=True,
        volumes=["/usr:/usr:ro"],
        labels={**labels, "cmlcluster.worker": "feed00-1", "cmlcluster.pid": str(os.getpid())},
    )
    # Their sessions' networks: the orphan's is taken once its container is gone; the live one's stays.
    orphan_network = client.networks.create(
        f"cmlcluster-feed01-{os.getpid()}",
        labels={**labels, "cmlcluster.session": "feed01", "cmlcluster.pid": str(dead.pid)},
    )
    alive_network = client.networks.create(
        f"cmlcluster-feed00-{os.getpid()}", labels={**labels, "cmlcluster.pid": str(os.getpid())}
    )
    try:
        assert remove_orphans(dry_run=True) == [orphan.name]
        assert remove_orphan_networks(dry_run=True) == [orphan_network.name]
        out = subprocess.run(
            [sys.executable, "-m", "cmlcluster", "cleanup"], capture_output=True, text=True, check=True
        ).stdout
        assert f"ended container {orphan.name}" in out and f"ended network {orphan_network.name}" in out
        left = client.containers.list(all=True, filters={"label": "cmlcluster.session"}, ignore_removed=True)
        assert [c.name for c in left if c.name in (orphan.name, alive.name)] == [alive.name]
        names = [n.name for n in client.networks.list(filters={"label": "cmlcluster.session"})]
        assert orphan_network.name not in names and alive_network.name in names
    finally:
        for c in (orphan, alive):
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
        for n in (orphan_network, alive_network):
            try:
                n.remove()
            except docker.errors.NotFound:
                pass


def test_errors_say_what_is_wrong_and_how_to_fix_it(monkeypatch, client):
    with Session(DockerBackend(image="no-such-image:1"), echo=False) as s:
        with pytest.raises(ConfigError, match=r"image='no-such-image:1' is not on this Docker engine; build it"):
            s.launch_workers(1, cpu=1, memory=1)
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE, network="host"), echo=False) as s:
        with pytest.raises(ConfigError, match=r"network='host' uses the 'host' driver"):
            s.launch_workers(1, cpu=1, memory=1)
    with pytest.raises(ConfigError, match=r"volumes: 'relative/data' is not an existing absolute path"):
        DockerBackend(volumes={"relative/data": "/data"})
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE), echo=False) as s:
        with pytest.raises(ConfigError, match=r"no Docker engine answers.*Start it: `dockerd &`"):
            s.launch_workers(1, cpu=1, memory=1)
