"""A user's session beside the test suite comes through it unharmed.

The run's root process starts the bystander (tests/harness/bystander.py) before the first test (conftest.py):
another process, not the run's child, with two local workers and a Docker worker, as a notebook on the
same machine would have. This test is the run's last (harness/run.py orders it so, and under pytest-xdist it
waits for the other workers' tests): after the whole run, the bystander's workers are the same
processes, still running, and no leak check of any process of the run ever reported one of them.
"""

from __future__ import annotations

import os
import time

import pytest
from harness import bystander, identity

pytestmark = [pytest.mark.integration, pytest.mark.bystander]

EVERYTHING_ELSE = 3000  # seconds, at most, for the other workers' tests (a hang guard: the run is far shorter)


@pytest.mark.timeout(EVERYTHING_ELSE + 300)
def test_a_session_beside_the_run_is_unharmed_and_never_reported(request):
    assert os.path.exists(identity.BYSTANDER), "the run's root starts the bystander when this test is collected"
    others = {item.nodeid for item in request.session.items} - {request.node.nodeid}
    deadline = time.monotonic() + EVERYTHING_ELSE
    while running := others - set(identity.read_lines(identity.FINISHED)):
        assert time.monotonic() < deadline, f"still running: {sorted(running)}"
        time.sleep(1)
    reported = identity.read_lines(identity.REPORTS)
    pids = {pid for report in reported for pid in report.get("pids", [])}
    containers = [name for report in reported for name in report.get("containers", [])]

    handle = bystander.Bystander.saved(identity.BYSTANDER)
    ready = handle.ready
    now = handle.check()
    assert now["statuses"] == ["running"] * 3, now
    assert now["worker_pids"] == ready["worker_pids"], (ready, now)  # the same processes: none restarted
    assert not set(ready["host_pids"]) & pids, reported
    assert not [name for name in containers if any(s in name for s in ready["session_ids"])], reported
    # Only the bystander stops its session, as its user would; its workers were never the run's to stop.
    stopped = handle.stop()
    assert stopped["closed"] == [True, True], stopped
