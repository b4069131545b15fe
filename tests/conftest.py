"""Shared fixtures. Every test is checked for leaked worker and controller processes."""

from __future__ import annotations

import os
import time

import psutil
import pytest

LEAK_PATTERNS = ("cmlcluster.agent", "cmlcluster._controller", "ipyparallel.controller", "ipyparallel.engine")


def cmlcluster_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != os.getpid() and any(p in cmdline for p in LEAK_PATTERNS):
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


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = {p.pid for p in cmlcluster_processes()}
    yield
    deadline = time.monotonic() + 15
    leaked = [p for p in cmlcluster_processes() if p.pid not in before]
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = [p for p in cmlcluster_processes() if p.pid not in before and p.is_running()]
    for p in leaked:  # do not let one leak fail every later test
        p.kill()
    assert not leaked, f"processes left behind: {[(p.pid, ' '.join(p.cmdline())) for p in leaked]}"
