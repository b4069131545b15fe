"""Shared fixtures. Every test is checked for leaked worker and controller processes, containers and
temp folders.

Tests that take the `backend` fixture (or a `session` built on it) run once per backend: on local
processes; on Docker containers made from the test image (scripts/docker_engine.sh), which
run this machine's own Python through read-only bind mounts; and on three SSH hosts (containers
with their own IPs running key-only sshd, logged into as a non-root user, that do NOT see the
tests' folders: see sshhosts.py).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import tempfile
import time

import psutil
import pytest

DOCKER_TEST_IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
BACKENDS = ("local", "docker", "ssh", "kubernetes")
SSH_SLOTS = 4  # per test host
KUBE_CLAIM = "tests-shared"  # the stand-in cluster's PersistentVolumeClaim: the tests' temp folder

LEAK_PATTERNS = (
    "cmlcluster.agent",
    "cmlcluster._controller",
    "cmlcluster.backends.ssh_remote",
    "ipyparallel.controller",
    "ipyparallel.engine",
    "cmlcluster.pytorch.launch",  # torchrun
    "cmlcluster/pytorch/rank.py",  # the processes it starts
)


def cmlcluster_processes() -> list[psutil.Process]:
    """Live worker and controller processes, those inside containers included (zombies are gone)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["pid"] == os.getpid():
            continue
        if any(p in cmdline for p in LEAK_PATTERNS):
            proc.info["cmdline_text"] = cmdline
            found.append(proc)
    return found


def alive_after(pids: list[int], within: float) -> list[int]:
    """The pids still running (zombies count as gone) once `within` seconds have passed or all are gone."""
    deadline = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return alive


@pytest.fixture
def wait_gone():
    return alive_after


@pytest.fixture(scope="session")
def ssh_hosts():
    """Three SSH hosts for the whole run (they start in about a second; nothing of a test stays on them)."""
    from sshhosts import start_hosts

    with start_hosts(3) as hosts:
        yield hosts


def leftovers_on(hosts) -> dict[str, list[str]]:
    """{host ip: processes and cmlcluster temp folders on it} for hosts with anything left."""
    found = {}
    for host in hosts.hosts:
        left = host.processes() + host.exec("sh", "-c", "ls -d /tmp/cmlcluster-* 2>/dev/null").stdout.split()
        if left:
            found[host.ip] = left
    return found


@pytest.fixture(autouse=True)
def nothing_left_on_ssh_hosts(request):
    """After a test on the SSH hosts: not a process nor a temp folder of it on any of them."""
    # Tests that use the hosts: by fixture, or parametrized over backends ("[ssh]", "[ssh-...]").
    if "ssh_hosts" not in request.fixturenames and "[ssh" not in request.node.name:
        yield
        return
    hosts = request.getfixturevalue("ssh_hosts")
    yield
    deadline = time.monotonic() + 15
    left = leftovers_on(hosts)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftovers_on(hosts)
    assert not left, f"left on the SSH hosts: {left}"


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    """The stand-in Kubernetes cluster (tests/kubestandin) for the whole run: its API on 127.0.0.1, its
    pods Docker containers that run this host's Python, with the tests' folder as a claim (KUBE_CLAIM)."""
    from kubestandin import StandInCluster

    shared = str(tmp_path_factory.getbasetemp())
    # A node big enough for any test's workers: its scheduler is real, and 2 CPUs would hold few pods.
    with StandInCluster(
        network="cmlcluster-kube", node_cpu="64", node_memory="256Gi", host_python=True, claims={KUBE_CLAIM: shared}
    ) as cluster:
        yield cluster


def kube_backend(cluster, **options):
    """A kubernetes backend on the stand-in cluster; options replace the defaults."""
    from cmlcluster.backends.kubernetes.backend import KubernetesBackend
    from cmlcluster.backends.kubernetes.manifests import SharedVolume

    settings = dict(
        image=DOCKER_TEST_IMAGE,
        namespace="default",
        controller_ip=cluster.gateway,  # the host, as the pods' network reaches it
        configuration=cluster.configuration(),
        python=sys.executable,  # the stand-in's node mounts this host's Python (host_python)
        # The tests' folder, mounted at the same path in every pod (and seen by the session, as a
        # notebook pod with the same claim would), like docker's shared volume.
        shared_volume=SharedVolume(KUBE_CLAIM, cluster.claims[KUBE_CLAIM]),
    )
    return KubernetesBackend(**(settings | options))


def ssh_backend(hosts, slots: int = SSH_SLOTS, **options):
    from cmlcluster.backends.ssh import SSHBackend

    login = {"user": hosts.user, "identity": hosts.identity_file, "known_hosts": hosts.known_hosts}
    return SSHBackend([f"{h.ip}:{slots}" for h in hosts.hosts], python=hosts.python, **{**login, **options})


@pytest.fixture
def worker_startup_hook(request, tmp_path):
    """hook(backend, code) -> env: workers launched with that env run `code` when their Python starts.

    A sitecustomize.py on PYTHONPATH: in a folder the workers see (the tests' folder, mounted in
    containers), or written on every SSH host, which sees none of the session's files.
    """
    on_hosts = []

    def hook(backend, code: str) -> dict[str, str]:
        if getattr(backend, "name", backend) != "ssh":
            (tmp_path / "sitecustomize.py").write_text(code)
            return {"PYTHONPATH": str(tmp_path)}
        folder = f"/tmp/hook-{tmp_path.name}"
        write = f"import os; os.makedirs({folder!r}); open({folder!r} + '/sitecustomize.py', 'w').write({code!r})"
        for host in request.getfixturevalue("ssh_hosts").hosts:
            assert host.exec(sys.executable, "-c", write, user="alice").returncode == 0
            on_hosts.append((host, folder))
        return {"PYTHONPATH": folder}

    yield hook
    for host, folder in on_hosts:
        host.exec("rm", "-rf", folder)


def backend_for(name: str, shared: str):
    """The backend a parametrized test runs on (docker: `shared` is a folder workers see at the same path)."""
    if name == "docker":
        from cmlcluster.backends.docker import DockerBackend

        return DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True, volumes={shared: shared})
    return name


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path_factory):
    if request.param == "ssh":
        return ssh_backend(request.getfixturevalue("ssh_hosts"))
    if request.param == "kubernetes":
        return kube_backend(request.getfixturevalue("kube"))
    return backend_for(request.param, str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def session(backend):
    from cmlcluster import Session

    with Session(backend, echo=False) as s:
        yield s


@pytest.fixture
def shell():
    """A real IPython shell with cmlcluster's magics loaded; afterwards the default session is stopped
    and its backend is the default again (a test's use_backend must not follow the next test)."""
    from IPython.core.interactiveshell import InteractiveShell

    import cmlcluster

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "cmlcluster")
    yield ip
    cmlcluster.stop_session()
    cmlcluster.use_backend(None)


def cmlcluster_containers() -> list:
    try:
        import docker

        client = docker.from_env(timeout=10)
        return client.containers.list(all=True, filters={"label": "cmlcluster.session"}, ignore_removed=True)
    except Exception:  # no Docker engine: nothing to leak there
        return []


@pytest.fixture(autouse=True)
def no_leaked_containers():
    before = {c.id for c in cmlcluster_containers()}
    yield
    deadline = time.monotonic() + 15
    leaked = [c for c in cmlcluster_containers() if c.id not in before]
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = [c for c in cmlcluster_containers() if c.id not in before]
    names = [c.name for c in leaked]
    for c in leaked:
        c.remove(force=True)
    assert not leaked, f"containers left behind: {names}"


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = {p.pid for p in cmlcluster_processes()}
    yield
    deadline = time.monotonic() + 15
    leaked = [p for p in cmlcluster_processes() if p.pid not in before]
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = [p for p in cmlcluster_processes() if p.pid not in before]
    for p in leaked:  # do not let one leak fail every later test
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not leaked, f"processes left behind: {[(p.pid, p.info['cmdline_text']) for p in leaked]}"


def cmlcluster_temp_folders() -> set[str]:
    """Session folders, SSH key folders and sshd homes in the system's temp folder."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "cmlcluster-*")))


@pytest.fixture(autouse=True)
def no_leaked_temp_folders():
    before = cmlcluster_temp_folders()
    yield
    deadline = time.monotonic() + 15
    leaked = cmlcluster_temp_folders() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = cmlcluster_temp_folders() - before
    assert not leaked, f"temp folders left behind: {sorted(leaked)}"
