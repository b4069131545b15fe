"""A user's session beside the test suite comes through it unharmed.

conftest.py starts the bystander (tests/bystander.py) before the first test: another process, not the
run's child, with two local workers and a Docker worker, as a notebook on the same machine would have.
This test runs last (conftest orders it so): after the whole run, the bystander's workers are the same
processes, still running, and no leak check of the run ever reported one of them.
"""

from __future__ import annotations

import conftest
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.bystander]


def test_a_session_beside_the_run_is_unharmed_and_never_reported():
    bystander = conftest.BYSTANDER.get("handle")
    assert bystander is not None, "conftest starts the bystander when this test is collected"
    ready = bystander.ready
    now = bystander.check()
    assert now["statuses"] == ["running"] * 3, now
    assert now["worker_pids"] == ready["worker_pids"], (ready, now)  # the same processes: none restarted
    assert not set(ready["host_pids"]) & set(conftest.REPORTED["pids"]), conftest.REPORTED
    reported = [name for name in conftest.REPORTED["containers"] if any(s in name for s in ready["session_ids"])]
    assert not reported, reported
    # Only the bystander stops its session, as its user would; its workers were never the run's to stop.
    stopped = bystander.stop()
    conftest.BYSTANDER.pop("handle")
    bystander.remove()
    assert stopped["closed"] == [True, True], stopped
