"""The slurm backend against a real Slurm 22.05 cluster (tests/harness/slurm.py: a controller and two
slurmd containers, this host the submit host): workers are jobs that Slurm places by their cores, memory
and GPUs, one that does not fit waits with Slurm's reason, a job cancelled from outside is "stopped",
and nothing of a session stays in Slurm's queue."""

from __future__ import annotations

import time

import pytest
from harness.slurm import slurm_installed, start_slurm

from cmlcluster import Session
from cmlcluster.backends.slurm.backend import SlurmBackend

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not slurm_installed(), reason="Slurm is not installed (scripts/install.sh dev)"),
]


@pytest.fixture(scope="module")
def slurm():
    with start_slurm(nodes=2, cpus_per_node=2, memory_mb_per_node=2000, gpus_per_node=2) as cluster:
        yield cluster


def session_jobs(cluster, session) -> list[str]:
    """The lines squeue shows for the session's jobs, in any state but ended."""
    listed = cluster.run("squeue", "-h", "-o", "%j %T", check=True).stdout.splitlines()
    return [line for line in listed if line.startswith(f"cmlcluster-{session.id}-")]


def up(session, workers, timeout=60):
    ready = session.await_workers(workers, wait_for_completion=False, timeout_seconds=timeout)
    assert ready["failures"] == [], ready["failures"]
    return ready["workers"]


def test_workers_are_jobs_slurm_places_and_one_that_does_not_fit_waits_with_slurms_reason(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        running = up(session, session.launch_workers(2, cpu=2, memory=0.5))
        # A whole node each: two addresses, the nodes', and two jobs.
        assert {w["ip_address"] for w in running} == {n.ip for n in slurm.nodes}
        job_ids = {session.call(w, "os:getenv", "SLURM_JOB_ID") for w in running}
        assert len(job_ids) == 2 and all(job_ids)
        assert {session.call(w, "os:getenv", "CUDA_VISIBLE_DEVICES") for w in running} == {""}  # no GPU asked for
        waiting = session.launch_workers(1, cpu=2, memory=0.5)
        late = session.await_workers(waiting, wait_for_completion=False, timeout_seconds=6)
        assert [f["status"] for f in late["failures"]] == ["timedout"]
        assert "PENDING (Resources)" in late["failures"][0]["message"], late["failures"][0]["message"]
        session.stop_workers(*running)
        # Its place is free now: Slurm starts it.
        assert up(session, waiting)[0]["ip_address"] in {n.ip for n in slurm.nodes}
        assert len(session_jobs(slurm, session)) == 1
        session.stop_workers()
        assert session_jobs(slurm, session) == []


def test_a_job_cancelled_outside_is_stopped_and_a_gpu_worker_sees_its_own_gpu(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        [worker] = up(session, session.launch_workers(1, cpu=1, memory=0.5, nvidia_gpu=1))
        assert session.call(worker, "os:getenv", "CUDA_VISIBLE_DEVICES") == "0"
        job_id = session.call(worker, "os:getenv", "SLURM_JOB_ID")
        assert slurm.run("scancel", job_id, check=True).returncode == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            [now] = session.list_workers()
            if now["status"] != "running":
                break
            time.sleep(0.2)
        assert now["status"] == "stopped", now
        assert f"Slurm ended its job {job_id}: CANCELLED" in now["message"], now["message"]
        assert session_jobs(slurm, session) == []


def test_a_program_runs_on_a_node_and_its_output_comes_home(slurm):
    with Session(SlurmBackend(slurm_conf=slurm.conf), echo=False) as session:
        code = "import socket; print('hello from', socket.gethostname())"
        workers = session.launch_workers(1, cpu=1, memory=0.5, code=code)
        done = session.await_workers(workers, wait_for_completion=True, timeout_seconds=60)
        assert done["failures"] == [], done["failures"]
        said = session.output(workers[0])
        assert any(f"hello from {n.name}" in said for n in slurm.nodes), said
    assert session_jobs(slurm, session) == []
