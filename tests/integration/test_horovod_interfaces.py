"""Horovod on SSH hosts without horovodrun's interface probe, whose command lines carry a per-run secret.

Given no --network-interfaces, horovodrun finds the hosts' common interfaces by starting a task
service on each host over ssh (`python -m horovod.runner.task_fn ... <settings>`), the settings
pickled in base64 on the command line with the HMAC key of its driver and task services among
them: `ps` shows it to every user of the session's machine and of each host, and a signed request
to a task service runs a shell command as the session's user. cmlcluster names the interface each
host's worker reports (the one holding its address toward the session), so horovodrun never probes.

A watcher reads the command line of every process of the run's own tree on this machine (this
test process's descendants: horovodrun, its ssh clients) and of the test's own host containers
(their processes, seen in this machine's /proc) while the run lasts. Before, it saw task_fn on both.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
from harness.fixtures import ssh_backend
from harness.horovod_scripts import ALLREDUCE, ELASTIC_ALLREDUCE

from cmlcluster._proc import descendants
from cmlcluster.horovod import run_horovod

pytestmark = pytest.mark.integration


class CommandLines:
    """Every command line seen under `roots` (pids), read every 20 ms until stopped."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for root in self.roots:
                for pid in descendants(root):
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            text = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    except OSError:
                        continue
                    if text:
                        self.seen.add(text)
            self._stop.wait(0.02)

    def __enter__(self) -> CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def watched_hosts(ssh_hosts) -> Iterator[tuple[object, list[int]]]:
    """The SSH test hosts and the pids to watch: this test process and each host container's first process."""
    pytest.importorskip("horovod.tensorflow")
    roots = [os.getpid()]
    for host in ssh_hosts.hosts:
        host._container.reload()
        pid = host._container.attrs["State"]["Pid"]
        if not os.path.exists(f"/proc/{pid}"):
            pytest.skip("the Docker engine's containers are not this machine's processes (a remote engine)")
        roots.append(pid)
    yield ssh_hosts, roots


def check_no_probe(seen: set[str]) -> None:
    ranks = [line for line in seen if "cmlcluster.horovod.rank" in line]
    assert ranks, f"the watcher saw no rank start; it saw {sorted(seen)[:20]}"  # it did watch the run
    probes = [line[max(0, line.find("task_fn") - 60) :][:200] for line in seen if "task_fn" in line]
    assert not probes, probes


# Elastic runs name their interfaces the same way (the same argv builder): in the matrix tier.
@pytest.mark.parametrize("elastic", [False, pytest.param(True, marks=pytest.mark.matrix)], ids=["static", "elastic"])
def test_no_command_line_carries_horovods_service_key_on_ssh_hosts(watched_hosts, tmp_path, elastic):
    hosts, roots = watched_hosts
    script = tmp_path / "allreduce.py"
    script.write_text(ELASTIC_ALLREDUCE if elastic else ALLREDUCE)
    backend = ssh_backend(hosts, slots=1)
    with CommandLines(roots) as watcher:
        result = run_horovod(
            str(script), np=2, workers=2, backend=backend, start_timeout=60, max_restarts=1 if elastic else 0
        )
    check_no_probe(watcher.seen)
    assert result.ok, f"{result.message}\n" + "\n".join(result.driver_output[-30:])
    text = "\n".join(line for lines in result.output.values() for line in lines)
    assert text.count("of 2 sum 3") == 2, text
    if not elastic:
        assert "iface eth0" in text  # the containers' interface toward the session, as their workers reported it
