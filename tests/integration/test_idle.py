"""idle_timeout= and ttl= on real local workers (cmlcluster/idle.py): an idle worker is stopped, its row
counting down first, while one that works in bursts runs on; a session's workers end at its ttl and it
launches no more."""

from __future__ import annotations

import threading

import pytest

from cmlcluster import ConfigError, Session

pytestmark = pytest.mark.integration

SAMPLED = {"CMLCLUSTER_USAGE_SECONDS": "0.5"}  # samples (usage.py) every half second: a short test
# A third of a core on average, in bursts: some half-second samples see nothing, the next ones work again.
BURSTS = """
import time
start = time.time()
while time.time() - start < 8:
    busy = time.time()
    while time.time() - busy < 0.3:
        pass
    time.sleep(0.7)
print("trained", flush=True)
"""


def test_an_idle_worker_is_stopped_counting_down_while_one_that_works_in_bursts_runs_on():
    rows: list[tuple[str, str, str | None]] = []
    lock = threading.Lock()

    def on_event(event) -> None:
        if event.kind == "status":
            with lock:
                rows.append((event.worker.id, event.worker.status, event.worker.message))

    with Session("local", echo=False, idle_timeout=4) as session:
        session.subscribe(on_event)
        [idle] = session.launch_workers(1, cpu=0.5, memory=0.5, env=SAMPLED)  # no program: it only waits
        [busy] = session.launch_workers(1, cpu=0.5, memory=0.5, env=SAMPLED, code=BURSTS)
        session.await_workers([idle, busy], timeout_seconds=60)
        by_id = {w["id"]: w for w in session.list_workers()}
        session.drain()
    assert by_id[busy["id"]]["status"] == "succeeded", by_id[busy["id"]]
    stopped = by_id[idle["id"]]
    assert stopped["status"] == "stopped", stopped
    assert stopped["message"].startswith(f"worker {idle['id']} stopped: idle for "), stopped["message"]
    assert "(idle_timeout=4 s): under 5 % of a core and no GPU busy" in stopped["message"]
    # Its row counted down before (from half of idle_timeout on), the busy one's never did.
    countdown = [m for w, s, m in rows if w == idle["id"] and s == "running" and m and m.startswith("idle for ")]
    assert countdown and all("unless it works" in m for m in countdown), rows
    assert not [m for w, _, m in rows if w == busy["id"] and m and "idle" in m], rows


def test_a_sessions_workers_end_at_its_ttl_and_it_launches_no_more():
    with Session("local", echo=False, ttl=3) as session:
        [worker] = session.launch_workers(1, cpu=0.5, memory=0.5, code="import time; time.sleep(600)")
        session.await_workers([worker], timeout_seconds=60)
        [ended] = session.list_workers()
        assert ended["status"] == "stopped", ended
        said = f"worker {worker['id']} stopped: the session's ttl (3 s since its first launch) ran out"
        assert ended["message"] == said
        with pytest.raises(ConfigError, match=r"^ttl=3: this session's time ran out, and it launches no more"):
            session.launch_workers(1, cpu=0.5, memory=0.5)
