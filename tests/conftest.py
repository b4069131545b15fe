"""Shared fixtures, and what a test run owns.

A run owns only what it starts. Before any test, this file gives the run a tag (CMLCLUSTER_RUN_TAG,
which every container of its sessions and test hosts carries as a label), a state folder for session
records (CMLCLUSTER_STATE_DIR: `cmlcluster list` on this machine never shows the run's sessions) and a
temp folder (TMPDIR) of its own, and makes the pytest process a child subreaper, so that every process
the run starts stays in its tree, orphans included. After each test that can start anything, the leak
checks look there and only there (tests/processes.py): a process of its tree, a container with its tag,
a folder in its temp folder. A user's session running beside the suite is never listed, read or stopped
(tests/integration/test_bystander.py proves it).

Tests that take the `backend` fixture (or a `session` built on it) run once per backend: on local
processes; on Docker containers made from the test image (scripts/docker_engine.sh), which
run this machine's own Python through read-only bind mounts; on three SSH hosts (containers
with their own IPs running key-only sshd, logged into as a non-root user, that do NOT see the
tests' folders: see sshhosts.py); and on pods of the stand-in Kubernetes cluster (tests/kubestandin).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid

import psutil
import pytest

from cmlcluster.backends.base import RUN_TAG_ENV

# A run is this pytest process and, with pytest-xdist (`-n 2` in pyproject.toml), its workers. The first
# process, the root, makes the run's folder and tag; each worker gets a tag of its own below the root's
# ("<root tag>-gw0"), so that its leak checks see only what it started and the root's last sweep sees all.
ROOT_ENV = "CMLCLUSTER_TESTS_ROOT"  # the root's folder, for every process of the run
IS_ROOT = ROOT_ENV not in os.environ
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "" in the root
# Set at import, before any test module or session reads them; subprocesses (kernels, the CLI) inherit them.
RUN_TAG = f"tests-{uuid.uuid4().hex[:12]}" if IS_ROOT else f"{os.environ[RUN_TAG_ENV]}-{WORKER or os.getpid()}"
# Not named cmlcluster-*: what the run's programs write under its temp folder on an SSH host (a script's
# checkpoints, say) is theirs, not a session folder that a leak check looks for.
# A worker's folder lies beside the root's, not in it: chromium's socket path (at most 107 bytes) is in it.
RUN_DIR = tempfile.mkdtemp(prefix=f"{RUN_TAG}-", dir=None if IS_ROOT else os.path.dirname(os.environ[ROOT_ENV]))
# Also when the run never reaches its end (a usage error after this import: no pytest_sessionfinish).
atexit.register(shutil.rmtree, RUN_DIR, True)
ROOT_DIR = RUN_DIR if IS_ROOT else os.environ[ROOT_ENV]
os.environ[ROOT_ENV] = ROOT_DIR
os.environ[RUN_TAG_ENV] = RUN_TAG
os.environ["CMLCLUSTER_STATE_DIR"] = os.path.join(RUN_DIR, "state")
os.environ["TMPDIR"] = os.path.join(RUN_DIR, "tmp")
os.makedirs(os.environ["TMPDIR"])
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

import processes  # noqa: E402 - after the run's tag is set
from processes import alive_after, cmlcluster_processes, own_tree, run_containers, run_networks  # noqa: E402
from sshhosts import CONTAINER_LABEL as TEST_HOST_LABEL  # noqa: E402

DOCKER_TEST_IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
BACKENDS = ("local", "docker", "ssh", "kubernetes")


def on(*backends: str) -> list:
    """BACKENDS as a test's parameters: the named ones in the default run, the others in the matrix tier
    (pytest -m matrix), for behaviour that does not depend on where workers run."""
    return [b if b in backends else pytest.param(b, marks=pytest.mark.matrix) for b in BACKENDS]


SSH_SLOTS = 4  # per test host
KUBE_CLAIM = "tests-shared"  # the stand-in cluster's PersistentVolumeClaim: the tests' temp folder
LEAK_GRACE = 15.0  # seconds for what a test stopped to be gone, before it counts as left behind
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h

# What every process of the run shares, in the root's folder: what the leak checks reported and the
# tests that finished (one JSON line each, appended), and the bystander (tests/bystander.py).
REPORTS = os.path.join(ROOT_DIR, "reported.jsonl")
FINISHED = os.path.join(ROOT_DIR, "finished.jsonl")
BYSTANDER = os.path.join(ROOT_DIR, "bystander.json")


def append_line(path: str, record) -> None:
    """One JSON line, appended in one write: processes of the run append to the same file at once."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_lines(path: str) -> list:
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [json.loads(line) for line in f]
    return []


def pytest_collection_modifyitems(config, items):
    """The longest file first (pytest-xdist's other worker does the rest meanwhile), and the bystander's
    test last: it checks the bystander after everything else ran beside it."""
    first = [item for item in items if getattr(item.module, "LONGEST", False)]
    last = [item for item in items if item.get_closest_marker("bystander")]
    items[:] = first + [item for item in items if item not in first + last] + last


def pytest_collection_finish(session):
    """In every process that runs tests (without xdist, the root)."""
    if IS_ROOT and any(item.get_closest_marker("bystander") for item in session.items):
        start_bystander()
    become_subreaper()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """In the root, under xdist, as each worker has collected (the tests start once all have)."""
    if os.path.exists(BYSTANDER) or not any("test_bystander.py::" in i for i in ids):
        return
    start_bystander()
    become_subreaper()  # a worker that crashes leaves its orphans in the run's tree


def start_bystander() -> None:
    """Before this process adopts orphans, so that the bystander is not the run's."""
    import bystander

    bystander.start(DOCKER_TEST_IMAGE).save(BYSTANDER)


def become_subreaper() -> None:
    """A process whose parent dies comes to this process, not to init: it stays in the run's tree."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


FILE_SECONDS: dict[str, float] = {}  # the root's: each test file's setup, call and teardown, summed


def pytest_runtest_logreport(report):
    """In the root, under xdist, each worker's reports arrive here too."""
    path = report.nodeid.split("::")[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, a line per file, longest first (the tiers are sized from this)."""
    if not IS_ROOT or not FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file (both processes' time together)")
    for path, seconds in sorted(FILE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(FILE_SECONDS.values()):8.1f}  in all")


def pytest_runtest_logfinish(nodeid, location):
    append_line(FINISHED, nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """In the root: a test whose worker crashed will not say it finished."""
    append_line(FINISHED, crashitem)


@pytest.hookimpl(trylast=True)  # after xdist has ended its workers
def pytest_sessionfinish(session, exitstatus):
    """Every process of the run leaves nothing of its own: what is left now is reported, then removed.
    The root also stops the bystander if its test did not, and sweeps every worker's containers."""
    if IS_ROOT and os.path.exists(BYSTANDER):
        import bystander

        handle = bystander.Bystander.saved(BYSTANDER)
        if not handle.stopped():  # its test stops it; this is for a run that ended before its test
            with contextlib.suppress(AssertionError):
                handle.stop()
        handle.remove()
    left = [f"{p.pid} {processes.command_line(p)}" for p in cmlcluster_processes()]
    containers = run_containers(whole_run=IS_ROOT)
    left += [f"container {c.name}" for c in containers]
    for c in containers:
        c.remove(force=True)
    networks = run_networks(whole_run=IS_ROOT)  # free once their containers are gone
    left += [f"network {n.name}" for n in networks]
    for n in networks:
        with contextlib.suppress(Exception):
            n.remove()
    for p in own_tree():  # this process's, and only its
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            p.kill()
    if left:
        print(f"\nthe test run left behind: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # The root's folder and, as their tags begin with its, its workers' (one that crashed leaves its own).
    mine = glob.glob(os.path.join(os.path.dirname(RUN_DIR), f"{RUN_TAG}-*")) if IS_ROOT else [RUN_DIR]
    for folder in mine:
        shutil.rmtree(folder, ignore_errors=True)


def checks_leaks(request) -> bool:
    """Unit tests start nothing (the fake backend has no processes) and pay nothing for the checks."""
    return "unit" not in request.node.path.parts


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
    """{host ip: processes and cmlcluster temp folders (a worker's own, its short TMPDIR) on it} for hosts
    with anything left."""
    found = {}
    for host in hosts.hosts:
        left = host.processes() + host.exec("sh", "-c", "ls -d /tmp/cmlcluster-* /tmp/cml-* 2>/dev/null").stdout.split()
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
    left = settle(lambda: leftovers_on(hosts))
    assert not left, f"left on the SSH hosts: {left}"


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


@pytest.fixture
def shell():
    """A real IPython shell with cmlcluster's magics loaded (the default session it uses is stopped
    afterwards: default_session_as_found)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "cmlcluster")
    return ip


def settle(find):
    """What `find()` still returns once LEAK_GRACE has passed or it returns nothing."""
    deadline = time.monotonic() + LEAK_GRACE
    found = find()
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = find()
    return found


@pytest.fixture(autouse=True)
def no_leaked_containers(request):
    """No container or session network of the run's made during the test is left (but the run's SSH
    test hosts)."""
    if not checks_leaks(request):
        yield
        return
    before = {c.id for c in run_containers()}
    networks_before = {n.id for n in run_networks()}
    yield
    # The SSH test hosts stay for the whole run (a session fixture, perhaps started by this test).
    leaked = settle(lambda: [c for c in run_containers() if c.id not in before and TEST_HOST_LABEL not in c.labels])
    names = [c.name for c in leaked]
    for c in leaked:  # do not let one leak fail every later test
        c.remove(force=True)
    leaked_networks = settle(lambda: [n for n in run_networks() if n.id not in networks_before])
    names += [f"network {n.name}" for n in leaked_networks]
    for n in leaked_networks:
        with contextlib.suppress(Exception):
            n.remove()
    if names:
        append_line(REPORTS, {"containers": names})
    assert not names, f"containers left behind: {names}"


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    """No worker, controller, rank or horovodrun started during the test is left in the run's tree."""
    if not checks_leaks(request):
        yield
        return
    before = {p.pid for p in cmlcluster_processes()}
    yield
    leaked = settle(lambda: [p for p in cmlcluster_processes() if p.pid not in before])
    described = [(p.pid, processes.command_line(p)) for p in leaked]
    if leaked:
        append_line(REPORTS, {"pids": [p.pid for p in leaked]})
    for p in leaked:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not leaked, f"processes left behind: {described}"


def cmlcluster_temp_folders() -> set[str]:
    """Session folders, SSH key folders and sshd homes in the run's temp folder."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "cmlcluster-*")))


@pytest.fixture(autouse=True)
def no_leaked_temp_folders(request):
    if not checks_leaks(request):
        yield
        return
    before = cmlcluster_temp_folders()
    yield
    leaked = settle(lambda: sorted(cmlcluster_temp_folders() - before))
    assert not leaked, f"temp folders left behind: {leaked}"


SIGNALS_A_TEST_MUST_LEAVE = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def signal_handlers_as_found(request):
    """A test leaves this process's signal handlers as it found them: a handler left behind changes what
    Ctrl-C and the widget's Stop do in every later test of this xdist worker (the Stop tests met one,
    left by asyncio in test_notebooks). Put back, so that later tests are not affected, and failed."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS_A_TEST_MUST_LEAVE}
    yield
    changed = {sig: signal.getsignal(sig) for sig, h in before.items() if signal.getsignal(sig) is not h}
    for sig in changed:
        signal.signal(sig, before[sig])
    left = ", ".join(f"{signal.Signals(s).name} {h!r} (was {before[s]!r})" for s, h in changed.items())
    assert not changed, f"the test left signal handlers changed: {left}"


@pytest.fixture(autouse=True)
def default_session_as_found(no_leaked_containers, no_leaked_processes, no_leaked_temp_folders):
    """After each test, no default session and no backend choice: a test's use_backend (or run_horovod's
    reuse=True, which makes one) must not follow the next test in this process. Set up after the leak
    checks (it takes them), so torn down before them: the default session's workers are the test's."""
    yield
    api = sys.modules.get("cmlcluster.api")
    if api is not None and (api._default is not None or api._backend is not None):
        api.stop_session()
        api.use_backend(None)
