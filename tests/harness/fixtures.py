"""What tests run on (a pytest plugin, loaded by tests/conftest.py): the backends, sessions on them, a real
IPython shell, the SSH test hosts and the stand-in Kubernetes cluster.

Tests that take the `backend` fixture (or a `session` built on it) run once per backend: on local
processes; on Docker containers made from the test image (scripts/docker_engine.sh), which run this
machine's own Python through read-only bind mounts; on three SSH hosts (containers with their own IPs
running key-only sshd, logged into as a non-root user, that do NOT see the tests' folders:
tests/harness/sshhosts.py); and on pods of the stand-in Kubernetes cluster (tests/kubestandin). The
Slurm backend's tests and the backend contract run on a real Slurm cluster (tests/harness/slurm.py).
"""

from __future__ import annotations

import os
import sys

import pytest

from harness.processes import alive_after
from harness.run import DOCKER_TEST_IMAGE

BACKENDS = ("local", "docker", "ssh", "kubernetes")


def on(*backends: str) -> list:
    """BACKENDS as a test's parameters: the named ones in the default run, the others in the matrix tier
    (pytest -m matrix), for behaviour that does not depend on where workers run."""
    return [b if b in backends else pytest.param(b, marks=pytest.mark.matrix) for b in BACKENDS]


SSH_SLOTS = 4  # per test host
KUBE_CLAIM = "tests-shared"  # the stand-in cluster's PersistentVolumeClaim: the tests' temp folder


@pytest.fixture
def wait_gone():
    return alive_after


@pytest.fixture(scope="session")
def ssh_hosts():
    """Three SSH hosts for the whole run (they start in about a second; nothing of a test stays on them)."""
    from harness.sshhosts import start_hosts

    with start_hosts(3) as hosts:
        yield hosts


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm 22.05 cluster (tests/harness/slurm.py) for the whole run: a controller and two nodes of 2
    cores, 2000 MB and 2 GPUs (device-node GRES) each, this host its submit host. Up in about 1.5 s."""
    from harness.slurm import start_slurm

    with start_slurm(nodes=2, cpus_per_node=2, memory_mb_per_node=2000, gpus_per_node=2) as cluster:
        yield cluster


def slurm_backend(cluster, **options):
    from cmlcluster.backends.slurm.backend import SlurmBackend

    return SlurmBackend(slurm_conf=cluster.conf, **options)


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    """The stand-in Kubernetes cluster (tests/kubestandin) for the whole run: its API on 127.0.0.1, its
    pods Docker containers that run this host's Python, with the tests' folder as a claim (KUBE_CLAIM)."""
    from kubestandin import StandInCluster

    shared = kube_folder(str(tmp_path_factory.getbasetemp()), 0o2750)
    # A node big enough for any test's workers: its scheduler is real, and 2 CPUs would hold few pods.
    with StandInCluster(node_cpu="64", node_memory="256Gi", host_python=True, claims={KUBE_CLAIM: shared}) as cluster:
        yield cluster


def kube_folder(path, mode):
    """A host folder made usable by the stand-in's pods, which run as random uids in the backend's
    default fsGroup: a claim is a host folder whose ownership no kubelet manages, like an NFS export
    prepared for a group."""
    from cmlcluster.backends.kubernetes.options import DEFAULT_FS_GROUP

    os.chown(path, -1, DEFAULT_FS_GROUP)
    os.chmod(path, mode)
    return path


@pytest.fixture(autouse=True)
def kube_tmp_path(request):
    """A Kubernetes test's tmp_path, which its pods write through the claim, is their group's too."""
    if "[kubernetes" in request.node.name or "kube" in request.fixturenames:
        kube_folder(request.getfixturevalue("tmp_path"), 0o2770)
    yield


def kube_backend(cluster, **options):
    """A kubernetes backend on the stand-in cluster; options replace the defaults."""
    from cmlcluster.backends.kubernetes.backend import KubernetesBackend
    from cmlcluster.backends.kubernetes.options import SharedVolume

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
    from cmlcluster.backends.ssh.backend import SSHBackend

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
        from cmlcluster.backends.docker.backend import DockerBackend

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
