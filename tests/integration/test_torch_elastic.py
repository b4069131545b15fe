"""Elastic PyTorch runs (run_torch's max_restarts): a worker killed -9 mid-training is replaced, the ranks
restart, and the example resumes from its last snapshot, to the loss of an undisturbed run; the
rendezvous, hosted by the session, outlives any worker, rank 0's included; restarts used up fail the
run with the job's structured failure and leave nothing running."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import psutil
import pytest
from harness.processes import agent_pid, own_tree, processes_running, wait_until

from cmlcluster import Session, run_torch
from cmlcluster.events import JobChanged, Progress
from cmlcluster.pytorch.store import SessionStore

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "torch_ddp_train.py"
EPOCHS = 20
ARGS = ["--epochs", str(EPOCHS), "--samples", "8192"]
# An undisturbed run of these ends at 0.0203 (from about 24); resumed from a snapshot at the same world
# size, it repeats the same steps and ends at the same parameters (seen: the same checksum).
UNDISTURBED_LOSS = 0.0203


class Killer:
    """kill -9s the agents of the run's workers, one per entry of `victims` (a function of the session's
    workers in launch order, replacements last): the first once rank 0 has reported an epoch (so after a
    snapshot, mid-training), each next one once the last one's replacement is in and, with `trained`,
    has trained an epoch."""

    def __init__(self, session: Session, victims, trained: bool = True):
        self.session = session
        self.victims = list(victims)
        self.trained = trained
        self.killed: list[str] = []
        self.epochs = 0  # rank 0's reports since the last replacement
        self.replaced = 0
        self.lock = threading.Lock()
        session.subscribe(self.on_event)

    def on_event(self, event) -> None:
        with self.lock:
            if isinstance(event, Progress) and event.task == "rank 0":
                self.epochs += 1
            elif isinstance(event, JobChanged) and event.state == "member_replaced":
                self.replaced += 1
                self.epochs = 0
            if len(self.killed) == len(self.victims) or self.replaced < len(self.killed):
                return
            if self.epochs or (self.killed and not self.trained):
                victim = self.victims[len(self.killed)](self.session.list_workers())["id"]
                self.killed.append(victim)
                threading.Thread(target=self.kill, args=(victim,), daemon=True).start()

    def kill(self, worker_id: str) -> None:
        os.kill(wait_until(lambda: agent_pid(worker_id), 30, f"worker {worker_id}'s agent"), signal.SIGKILL)


def final_loss(result) -> float:
    return float(re.findall(r"epoch \d+ loss ([\d.]+)", "\n".join(result.output[0]))[-1])


@pytest.mark.parametrize(
    ("backend", "node"),
    [
        # In the default run node 0, whose address the rendezvous had, replaced (with a new address: Docker and
        # Slurm, in the matrix tier).
        pytest.param("local", 1, marks=pytest.mark.matrix),
        ("local", 0),
        pytest.param("docker", 0, marks=pytest.mark.matrix),
        pytest.param("ssh", 1, marks=pytest.mark.matrix),
        pytest.param("kubernetes", 0, marks=pytest.mark.matrix),
    ],
    ids=[
        "local node 1",
        "local node 0 (the rendezvous is the session's)",
        "docker node 0 (and its address)",
        "ssh node 1",
        "kubernetes node 0",
    ],
    indirect=["backend"],
)
def test_a_worker_killed_mid_training_is_replaced_and_training_resumes_from_its_snapshot(backend, node):
    with Session(backend, echo=False) as session:
        killer = Killer(session, [lambda workers: workers[node]])
        result = run_torch(str(EXAMPLE), ARGS, nnodes=2, max_restarts=2, session=session, echo=False)
        assert result.ok, result.message
        assert result.restarts == 1 and killer.killed and killer.replaced == 1
        assert result.master.startswith(f"{session.controller_ip}:")  # the session hosts the rendezvous
        workers = session.list_workers()
        assert [w["status"] for w in workers] == ["failed" if w["id"] in killer.killed else "stopped" for w in workers]
    texts = {rank: "\n".join(lines) for rank, lines in result.output.items()}
    assert sorted(texts) == [0, 1]  # labelled by each round's ranks
    resumed = re.findall(r"resumed after epoch (\d+) from rank (\d+)'s snapshot", texts[0])
    assert resumed and 1 <= int(resumed[-1][0]) < EPOCHS, texts[0]
    assert f"epoch {EPOCHS} loss" in texts[0]
    assert len(set(re.findall(r"parameters (\w+)", "\n".join(texts.values())))) == 1  # every rank the same
    assert final_loss(result) < 1.5 * UNDISTURBED_LOSS, final_loss(result)
    assert not processes_running(EXAMPLE)


def test_restarts_used_up_fail_the_run_with_the_jobs_failure_and_leave_nothing_running():
    with Session("local", echo=False) as session:
        # Node 1, then its replacement (the third worker launched) as soon as it is in.
        killer = Killer(session, [lambda workers: workers[1], lambda workers: workers[2]], trained=False)
        result = run_torch(str(EXAMPLE), ARGS, nnodes=2, max_restarts=1, session=session, echo=False)
        assert not result.ok and result.restarts == 1 and len(killer.killed) == 2
        failure = result.worker_failure
        assert failure is not None and failure.member.worker_id == killer.killed[1] and failure.exit_code == -9
        assert result.message.startswith("the PyTorch job failed after 1 restart: node task 1"), result.message
        statuses = {w["id"]: w["status"] for w in session.list_workers()}
        assert sorted(statuses.values()) == ["failed", "failed", "stopped"], statuses
        wait_until(lambda: not processes_running(EXAMPLE), 10, "no rank left")


def test_the_sessions_rendezvous_store_listens_on_one_address_and_dies_with_its_lifeline():
    from torch.distributed import TCPStore

    store = SessionStore("127.0.0.1")
    try:
        client = TCPStore("127.0.0.1", store.port, is_master=False)
        client.set("round", "1")
        assert client.get("round") == b"1"
        listening = {c.laddr for p in own_tree() for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", store.port)}
    finally:
        store.close()
    assert store._process.returncode == -signal.SIGKILL  # the lifeline's end: its whole group killed
