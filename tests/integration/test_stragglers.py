"""Stragglers named on real workers (issue 38): three local workers report their steps through their
output as ranks do, one at a third of the others' pace; the session names it, with its worker, and the
views say what that worker uses."""

from __future__ import annotations

import time

import pytest

from cmlcluster import Session
from cmlcluster.events import Straggler
from cmlcluster.ui.model import Router

pytestmark = pytest.mark.integration

REPORTER = """
import time, cmlcluster
for step in range(100_000):
    cmlcluster.report(step, task="rank {rank}")
    time.sleep({pause})
"""


def test_a_rank_at_a_third_of_its_peers_pace_is_named_with_what_its_worker_uses():
    with Session("local", echo=False, straggler_window=3) as session:
        flags: list[Straggler] = []
        router = Router()
        session.subscribe(router.apply)
        session.subscribe(lambda e: flags.append(e) if isinstance(e, Straggler) else None)
        workers = [
            session.launch_workers(1, cpu=0.5, memory=0.5, code=REPORTER.format(rank=rank, pause=pause))[0]
            for rank, pause in ((0, 0.05), (1, 0.05), (2, 0.15))
        ]
        deadline = time.monotonic() + 30
        while not flags and time.monotonic() < deadline:
            time.sleep(0.1)
        session.drain()
        assert [(f.task, f.worker, f.over) for f in flags] == [("rank 2", workers[2]["id"], False)]
        assert flags[0].rate < 0.7 * flags[0].median
        # The views name it with what its worker uses now (its samples come every 2 s).
        while workers[2]["id"] not in router.whole.usage and time.monotonic() < deadline:
            time.sleep(0.1)
        [line] = router.whole.straggler_lines()
        assert line.startswith("rank 2 is a straggler: ") and "; its worker uses " in line and "% CPU" in line
        session.stop_workers(workers[2])
        session.drain()
        assert router.whole.straggler_lines() == []  # gone with its worker
