"""Elastic Horovod runs (run_horovod's max_restarts), real horovodrun over real SSH: a worker killed -9
mid-training is replaced, the new host gets sshd, its pinned key and the run's env, horovodrun's discovery
lists it, and the example's hvd.elastic.run carries the surviving rank's state over, to the loss of an
undisturbed run; on this machine horovodrun starts a killed rank again itself; restarts used up fail the
run with the job's structured failure and leave nothing running."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import psutil
import pytest
from harness.fixtures import backend_for
from harness.processes import agent_pid, processes_running, wait_until

from cmlcluster import Session
from cmlcluster.events import JobChanged, Progress
from cmlcluster.horovod import run_horovod

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "worker_scripts" / "horovod_keras_train.py"
STEPS = 20
ARGS = ["--epochs", "80", "--steps-per-epoch", str(STEPS)]  # long enough for a new rank to start and join
# Longer: the survivor trains on alone while the killed rank's host cools down (horovod: 2 to 3 s for a first
# loss) and its new rank starts. The new rank was back by step 1,600 in a run alone and by step 1,200 with
# both cores kept busy by two other processes (the survivor slows too): these 4,000 steps leave twice that.
LOCAL_ARGS = ["--epochs", "200", "--steps-per-epoch", str(STEPS)]
# An undisturbed run of these ends at 0.0007 (from 0.24) on 2 ranks, its last epochs between about 0.0003
# and 0.002; a run that lost a rank trained a while on one, repeats the steps since its last commit, and ends
# in the same range: ci41's ended at 0.0044 (one epoch's loss is noisy at this size). The bound, 10 times the
# undisturbed end, is still 34 times under the first epoch's loss (0.24) and 10 times under the second's
# (0.071), where training stood when the kill came (after rank 0's first epoch).
UNDISTURBED_LOSS = 0.0007
LOSS_BOUND = 10 * UNDISTURBED_LOSS


# run_horovod(echo=True) publishes the ranks' progress to the session (whose own echo is off): the Killer sees it.
class Killer:
    """kill -9s, one per entry of `victims` (a function of the session, returning a pid): the first once
    rank 0 has trained an epoch, each next one once the last one's replacement is in."""

    def __init__(self, session: Session, victims):
        self.session = session
        self.victims = list(victims)
        self.killed: list[int] = []
        self.replaced = 0
        self.reporting_since_replaced: set[str] = set()  # the tasks whose progress came after the first replacement
        self.lock = threading.Lock()
        session.subscribe(self.on_event)

    def on_event(self, event) -> None:
        with self.lock:
            if isinstance(event, JobChanged) and event.state == "member_replaced":
                self.replaced += 1
            if isinstance(event, Progress) and self.replaced:
                self.reporting_since_replaced.add(event.task)
            if len(self.killed) == len(self.victims) or self.replaced < len(self.killed):
                return
            trained = isinstance(event, Progress) and event.task == "rank 0" and event.step >= STEPS
            if trained or (self.killed and self.replaced == len(self.killed)):
                self.killed.append(0)  # taken; the pid comes on the thread
                threading.Thread(target=self.kill, args=(len(self.killed) - 1,), daemon=True).start()

    def kill(self, i: int) -> None:
        pid = wait_until(lambda: self.victims[i](self.session), 30, "the victim")
        os.kill(pid, signal.SIGKILL)
        self.killed[i] = pid


def final_loss(result, rank=None) -> float:
    """The last loss a rank printed: `rank`'s, or any rank's. Ranks are numbered again at each reset, so
    after a loss the survivor may print as rank 1, and a rank that joined after the last epoch began has
    no loss to print (seen in CI)."""
    ranks = [rank] if rank is not None else sorted(result.output)
    found = [float(x) for r in ranks for x in re.findall(r"loss [\d.]+ -> ([\d.]+)", "\n".join(result.output[r]))]
    assert found, result.output
    return max(found)


def worker(index):
    return lambda session: agent_pid(session.list_workers()[index]["id"])


def local_rank_process(rank):
    def find(session):
        for p in processes_running(EXAMPLE):
            try:
                if p.environ().get("HOROVOD_RANK") == str(rank):
                    return p.pid
            except psutil.Error:
                continue
        return None

    return find


# Local workers: test_a_local_rank_killed_mid_training_is_started_again_by_horovodrun (one host for horovodrun,
# in the matrix tier).
@pytest.mark.parametrize(
    "backend", ["docker", *(pytest.param(b, marks=pytest.mark.matrix) for b in ("ssh", "kubernetes"))], indirect=True
)
def test_a_worker_killed_mid_training_is_replaced_and_training_goes_on(backend):
    # Without env=: the new host's ranks still find the run's (empty) env file.
    with Session(backend, echo=False) as session:
        killer = Killer(session, [worker(1)])
        result = run_horovod(str(EXAMPLE), ARGS, np=2, cpu=0.5, memory=1, max_restarts=2, session=session)
        assert result.ok, result.message
        assert result.restarts == 1 and killer.killed and killer.replaced == 1
        assert "--host-discovery-script" in result.argv and "-H" not in result.argv
        # Each rank reports as the rank it is now: the survivor and the rank that joined are two (seen before:
        # both "rank 1", the number each had started with).
        assert killer.reporting_since_replaced == {"rank 0", "rank 1"}, killer.reporting_since_replaced
        workers = session.list_workers()
        assert [w["status"] for w in workers] == ["stopped", "failed", "stopped"]
    texts = {rank: "\n".join(lines) for rank, lines in result.output.items()}
    assert sorted(texts) == [0, 1]
    checksums = set(re.findall(r"weights checksum (\S+)", "\n".join(texts.values())))
    assert len(checksums) == 1, texts  # the new rank got the survivor's state, and both trained on
    assert final_loss(result) < LOSS_BOUND, final_loss(result)
    assert not processes_running(EXAMPLE)


# horovodrun's own restart of a rank on its one host (4,000 steps, 45 to 70 s here): in the matrix tier. In the
# default run, cmlcluster's replacement of a lost worker, above.
@pytest.mark.matrix
def test_a_local_rank_killed_mid_training_is_started_again_by_horovodrun():
    with Session("local", echo=False) as session:
        killer = Killer(session, [local_rank_process(1)])
        result = run_horovod(str(EXAMPLE), LOCAL_ARGS, np=2, max_restarts=1, session=session)
        assert result.ok, result.message
        assert killer.killed and result.restarts == 1
        assert result.hosts == [("localhost", 1), ("127.0.0.1", 1)]
    texts = {rank: "\n".join(lines) for rank, lines in result.output.items()}
    assert texts[1].count("rank 1 of size 2") == 2, texts[1]  # started again, and joined
    assert len(set(re.findall(r"weights checksum (\S+)", "\n".join(texts.values())))) == 1
    assert final_loss(result) < LOSS_BOUND, final_loss(result)
    wait_until(lambda: not processes_running(EXAMPLE), 10, "no rank left")


@pytest.mark.matrix  # the job layer's exhaustion, as for torch and TF (test_torch_elastic, test_tf_restarts)
def test_restarts_used_up_fail_the_run_with_the_jobs_failure_and_leave_nothing_running(tmp_path_factory):
    with Session(backend_for("docker", str(tmp_path_factory.getbasetemp())), echo=False) as session:
        # Worker 1, then its replacement (the third worker launched) once it is in.
        killer = Killer(session, [worker(1), worker(2)])
        result = run_horovod(str(EXAMPLE), ARGS, np=2, cpu=0.5, memory=1, max_restarts=1, session=session)
        assert not result.ok and result.restarts == 1 and len(killer.killed) == 2
        failure = result.worker_failure
        assert failure is not None and failure.exit_code == -9
        assert failure.member.worker_id == session.list_workers()[2]["id"]
        assert result.message.startswith("the Horovod job failed after 1 restart: host task 1"), result.message
        assert sorted(w["status"] for w in session.list_workers()) == ["failed", "failed", "stopped"]
        wait_until(lambda: not processes_running(EXAMPLE), 15, "no rank left")
