"""The leak checks (a pytest plugin, loaded by tests/conftest.py): after each test that can start anything,
nothing it started is left. They look in the run's own tree, containers and temp folder, and only there
(tests/harness/processes.py): a user's session running beside the suite is never listed, read or stopped
(tests/integration/test_bystander.py proves it).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import time

import psutil
import pytest

from harness import processes
from harness.identity import REPORTS, append_line
from harness.processes import cmlcluster_processes, run_containers, run_networks
from harness.sshhosts import CONTAINER_LABEL as TEST_HOST_LABEL

LEAK_GRACE = 15.0  # seconds for what a test stopped to be gone, before it counts as left behind
LEAK_CHECKS = ("no_leaked_containers", "no_leaked_processes", "no_leaked_temp_folders")


def checks_leaks(request) -> bool:
    """Unit tests start nothing (the fake backend has no processes) and pay nothing for the checks."""
    return "unit" not in request.node.path.parts


def settle(find):
    """What `find()` still returns once LEAK_GRACE has passed or it returns nothing."""
    deadline = time.monotonic() + LEAK_GRACE
    found = find()
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = find()
    return found


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
