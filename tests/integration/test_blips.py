"""A network blip is not a failure. A worker whose network is cut (every packet but loopback dropped in
its own network namespace, as a switch's failover or a Wi-Fi roam would) for less than the session's
silence_timeout carries on once it is back and its program finishes; one cut for longer fails with the
structured failure naming the silence, in bounded time, with nothing of it left running. On Docker
containers, on SSH hosts (containers standing in for machines: tests/harness/sshhosts.py) and on pods of the
stand-in Kubernetes cluster (whose pods are containers; matrix tier). An SSH worker also
outlives its ssh connection: one whose connection dropped (its ssh client killed, or ssh's keepalives
given up during a cut) is connected again, and its log holds what it printed meanwhile, once.

The cut is made with iptables in the worker's namespace (nsenter), never by `docker network
disconnect`: a container reconnected to its network may get another address, which is another test."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

import psutil
import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, kube_backend
from harness.leaks import leftovers_on
from harness.processes import own_tree, run_containers, wait_until

from cmlcluster import Session
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.backends.kubernetes import names
from cmlcluster.backends.ssh.backend import SSHBackend

pytestmark = pytest.mark.integration

BLIP = 15.0  # seconds without a packet: longer than any clock of the control plane allowed before
SHORT = 8.0  # a silence_timeout the long cut outlasts
# On SSH hosts the cut also outlasts ssh's keepalives, which give up after half of silence_timeout (20 s:
# keepalive_seconds): the connection drops and the session makes a new one. The control plane's TCP
# stream comes back at its next resend after the cut (exponential backoff: at about 25 s), within 40 s.
SSH_SILENCE, SSH_BLIP = 40.0, 23.0
STEPS = 80  # half a second each: the program runs through the blip and past TCP's next resend
PROGRAM = f"import time\nfor i in range({STEPS}):\n    print('step', i, flush=True)\n    time.sleep(0.5)\n"


@contextlib.contextmanager
def network_cut(pid: int):
    """Drop every packet in and out of pid's network namespace but loopback's, until the block ends."""
    rules = [["INPUT", "!", "-i", "lo", "-j", "DROP"], ["OUTPUT", "!", "-o", "lo", "-j", "DROP"]]
    added = []
    try:
        for rule in rules:
            subprocess.run(["nsenter", "-t", str(pid), "-n", "iptables", "-I", *rule], check=True)
            added.append(rule)
        yield
    finally:
        for rule in added:  # only the rules this added, in a namespace of this test's own worker or host
            if os.path.exists(f"/proc/{pid}"):  # else the namespace went with its container
                subprocess.run(["nsenter", "-t", str(pid), "-n", "iptables", "-D", *rule], check=True)


def docker_session(silence_timeout=None):
    backend = DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True)
    return Session(backend, echo=False, silence_timeout=silence_timeout)


def ssh_session(hosts, silence_timeout=None):
    # One host: the worker's, whose network the test cuts.
    login = {"user": hosts.user, "identity": hosts.identity_file, "known_hosts": hosts.known_hosts}
    backend = SSHBackend([hosts.hosts[0].ip], python=hosts.python, **login)
    return Session(backend, echo=False, silence_timeout=silence_timeout)


def session_for(kind, request, silence_timeout=None):
    if kind == "docker":
        return docker_session(silence_timeout)
    if kind == "kubernetes":
        return Session(kube_backend(request.getfixturevalue("kube")), echo=False, silence_timeout=silence_timeout)
    return ssh_session(request.getfixturevalue("ssh_hosts"), silence_timeout)


def reconnections(session, worker) -> int:
    """How many times the session connected to an SSH worker again: each time is a line of its log."""
    return len(re.findall(r"^\[cmlcluster: connected to \S+ again after ", session.worker_log(worker), re.M))


def ssh_clients() -> list[psutil.Process]:
    """The ssh processes in this process's own tree that carry a worker (the one worker of the test's
    session): its first connection's, or the one it attached again through."""
    return [p for p in own_tree() if p.name() == "ssh" and "cmlcluster.backends.ssh.remote" in p.cmdline()[-1]]


def container_of(kind, request, worker):
    """The container the worker runs in: its own, its pod's (the stand-in's pods are containers), or
    its SSH host's (tests/harness/sshhosts.py)."""
    if kind == "docker":
        [container] = run_containers(label=[f"cmlcluster.worker={worker['id']}"])
    elif kind == "kubernetes":
        pod = f"default/{names.pod_name(worker['id'])}"
        containers = request.getfixturevalue("kube").containers()
        [container] = [c for c in containers if c.labels.get("cmlcluster-standin.pod") == pod]
    else:
        container = request.getfixturevalue("ssh_hosts").hosts[0]._container
    return container


def namespace_pid(kind, request, worker) -> int:
    """A process in the worker's network namespace, as this machine sees it: its container's init."""
    container = container_of(kind, request, worker)
    container.reload()
    return int(container.attrs["State"]["Pid"])


def kinds(default: str, *matrix: str) -> list:
    """One kind of worker in the default run, the others in the matrix tier."""
    return [default, *(pytest.param(kind, marks=pytest.mark.matrix) for kind in matrix)]


def training(session):
    [worker] = session.launch_workers(1, cpu=0.5, memory=1, code=PROGRAM)
    wait_until(lambda: "step 2" in session.output(worker), 90, "the program training")
    return worker


def worker_processes_on(host) -> list[str]:
    return [line for line in host.processes() if "cmlcluster" in line]


# Each clock once in the default run: ssh's keepalives and the agents' watchdog through a blip on SSH
# hosts; the watchdog's end after the timeout in a container.
@pytest.mark.parametrize("kind", kinds("ssh", "docker", "kubernetes"))
def test_a_worker_cut_off_for_15_s_or_more_carries_on_and_its_program_succeeds(kind, request):
    blip = SSH_BLIP if kind == "ssh" else BLIP
    with session_for(kind, request, SSH_SILENCE if kind == "ssh" else None) as s:
        assert s.silence_timeout > blip  # the default for workers across a network, or SSH_SILENCE
        worker = training(s)
        with network_cut(namespace_pid(kind, request, worker)):
            time.sleep(blip)
            assert s.list_workers()[0]["status"] == "running"
        done = s.await_workers([worker], timeout_seconds=120)
        assert done["failures"] == [], done["failures"]
        assert [w["status"] for w in done["workers"]] == ["succeeded"]
        # What it printed while cut off arrived once it was back, in order and whole.
        assert s.output(worker).splitlines() == [f"step {i}" for i in range(STEPS)]
        if kind == "ssh":  # through a new ssh connection: its log has every line once too
            assert reconnections(s, worker) == 1
            assert steps_in(s.worker_log(worker)) == [f"step {i}" for i in range(STEPS)]


def steps_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("step")]


def test_a_worker_whose_ssh_client_is_killed_carries_on_and_its_log_has_each_line_once(ssh_hosts):
    # kill -9 of the session's ssh client: its connection drops at once; the worker's relay keeps it.
    program = "import time\nfor i in range(40):\n    print('step', i, flush=True)\n    time.sleep(0.1)\n"
    with ssh_session(ssh_hosts) as s:
        [worker] = s.launch_workers(1, cpu=0.5, memory=1, code=program)
        wait_until(lambda: "step 5" in s.worker_log(worker), 90, "the program printing")
        [ssh] = ssh_clients()
        killed = ssh.pid
        os.kill(killed, signal.SIGKILL)
        done = s.await_workers([worker], timeout_seconds=60)
        assert done["failures"] == [], done["failures"]
        log = s.worker_log(worker)
        assert steps_in(log) == [f"step {i}" for i in range(40)], log
        assert reconnections(s, worker) == 1
        assert f"the SSH connection to {ssh_hosts.hosts[0].ip} dropped (ssh was killed by signal 9)" in log


@pytest.mark.parametrize("kind", kinds("docker", "ssh", "kubernetes"))
def test_a_worker_cut_off_longer_than_silence_timeout_fails_naming_it_and_nothing_is_left(kind, request):
    with session_for(kind, request, silence_timeout=SHORT) as s:
        worker = training(s)
        pid = namespace_pid(kind, request, worker)
        container = container_of(kind, request, worker) if kind != "ssh" else None  # found while it runs
        with network_cut(pid):
            cut = time.monotonic()
            failed = wait_until(
                lambda: [w for w in s.list_workers() if w["status"] == "failed"], SHORT + 20, "the worker failed"
            )
            reported = time.monotonic() - cut
            # Ended where it runs, by its own agent, while still cut off from the session.
            if container is not None:
                wait_until(lambda: gone(container), 15, "the worker's container removed")
            else:
                host = request.getfixturevalue("ssh_hosts").hosts[0]
                wait_until(lambda: not worker_processes_on(host), 15, "no worker process on the host")
        [failure] = failed
        assert SHORT - 1 <= reported <= SHORT + 20, reported  # not before its silence_timeout: then promptly
        assert f"{SHORT:g} s" in failure["message"] and "silence_timeout" in failure["message"], failure
        if kind == "ssh":  # the session's ssh gave up on the host, as the agent did on the session
            assert f"lost the SSH connection to {host.ip}" in failure["message"]
            # sshd's side of the dead connection ends once its next resend meets the closed one.
            wait_until(lambda: not leftovers_on(request.getfixturevalue("ssh_hosts")), 60, "nothing on the host")
    print(f"{kind}: failed {reported:.1f} s after the cut (silence_timeout={SHORT:g} s): {failure['message']}")


def gone(container) -> bool:
    from docker.errors import NotFound

    try:
        container.reload()
    except NotFound:
        return True
    return False
