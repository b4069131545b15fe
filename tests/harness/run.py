"""The run as a whole (a pytest plugin, loaded by tests/conftest.py): the order of its files, the bystander
started before its first test, the pytest process a child subreaper (every process the run starts stays in
its tree, orphans included), where its time went, and at its end a sweep of whatever it left.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
import sys

import psutil
import pytest

from harness import processes
from harness.identity import BYSTANDER, FINISHED, IS_ROOT, RUN_DIR, RUN_TAG, append_line
from harness.processes import cmlcluster_processes, own_tree, run_containers, run_networks

DOCKER_TEST_IMAGE = os.environ.get("CMLCLUSTER_TEST_IMAGE", "cmlcluster-test:latest")
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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
    from harness import bystander

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
        from harness import bystander

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
