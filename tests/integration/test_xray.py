"""X-ray of real jobs while they run (issue 38): one rank held back from a collective its peers wait in is
named with its line, the others with the collective; nothing is disturbed, and the job ends well once
the rank is let go. PyTorch's four ranks on two local workers are read with py-spy; Horovod's ranks in
Docker containers, with py-spy turned off for them (as where a site forbids ptrace), through the
faulthandler dump their runner armed; TensorFlow's tasks run in the workers' agents and are read from the
agents themselves."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from harness.fixtures import on

from cmlcluster import run_cluster, run_horovod, run_torch
from cmlcluster.events import OutputLine
from cmlcluster.wire import PY_SPY_ENV

pytestmark = pytest.mark.integration

# Every rank says it is ready, then all meet in a barrier but the held rank, which first waits for the
# release file (its "deadlock"): the X-ray must find it at that line, and the others in the barrier.
TORCH_RANKS = """\
import os, sys, time
import torch.distributed as dist


def wait_for_release(path):
    while not os.path.exists(path):
        time.sleep(0.05)


dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
if rank == int(sys.argv[2]):
    wait_for_release(sys.argv[1])
dist.barrier()
print(f"rank {rank} passed", flush=True)
"""

HOROVOD_RANKS = """\
import os, sys, time
import horovod.tensorflow as hvd
import tensorflow as tf


def wait_for_release(path):
    while not os.path.exists(path):
        time.sleep(0.05)


hvd.init()
print(f"rank {hvd.rank()} ready", flush=True)
if hvd.rank() == int(sys.argv[2]):
    wait_for_release(sys.argv[1])
total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
print(f"rank {hvd.rank()} sum {float(total[0]):g}", flush=True)
"""


class Job:
    """A run in a thread of its own (it holds the caller as a cell would), and its ranks' "ready" lines."""

    def __init__(self, session, run, expected_ready: int):
        self.ready: set[str] = set()
        self.expected = expected_ready
        session.subscribe(
            lambda e: self.ready.add(e.text) if isinstance(e, OutputLine) and " ready" in e.text else None
        )
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self.thread.start()

    def _run(self, run) -> None:
        try:
            self.result = run()
        except BaseException as e:
            self.error = e

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready) < self.expected:
            assert self.error is None, self.error
            assert self.thread.is_alive(), f"the run ended before its ranks were ready: {self.result}"
            assert time.monotonic() < deadline, f"ready: {sorted(self.ready)}"
            time.sleep(0.1)
        time.sleep(0.5)  # past "ready": into the collective

    def finish(self, release: Path, timeout: float = 120):
        release.touch()
        self.thread.join(timeout)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.result


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_an_xray_names_the_torch_rank_held_out_of_a_barrier_and_the_job_ends_well(session, tmp_path):
    release = tmp_path / "release"
    train = script(tmp_path, "stuck.py", TORCH_RANKS)
    job = Job(
        session,
        lambda: run_torch(train, [str(release), "2"], nnodes=2, nproc_per_node=2, session=session, echo=False),
        4,
    )
    job.wait_ready()
    xray = session.xray()
    assert [u.rank for u in xray.units] == [0, 1, 2, 3] and xray.unanswered == {}
    assert [u.rank for u in xray.odd_ones_out()] == [2], str(xray)
    odd = xray.rank(2)
    assert odd.via == "py-spy"
    where = odd.main.innermost_users
    assert (where.where, where.function, where.source) == ("stuck.py:7", "wait_for_release", "time.sleep(0.05)")
    for rank in (0, 1, 3):
        waiting = xray.rank(rank)
        assert waiting.collective == "torch.distributed.barrier"
        assert waiting.main.innermost_users.source == "dist.barrier()"
    lines = str(xray).splitlines()
    assert lines[1] == "  ranks 0-1, 3: wait in torch.distributed.barrier, at stuck.py:15 in <module>: dist.barrier()"
    assert lines[3].startswith("    rank 2 (w1, pid ") and lines[3].endswith(
        "at stuck.py:7 in wait_for_release: time.sleep(0.05)"
    )
    result = job.finish(release)
    assert result.ok, result.message  # the X-ray disturbed nothing
    assert all(f"rank {r} passed" in "\n".join(result.output[r]) for r in range(4))


@pytest.mark.parametrize("backend", on("docker"), indirect=True)
def test_an_xray_reads_horovod_ranks_in_containers_through_their_dumps(session, tmp_path):
    release = tmp_path / "release"
    train = script(tmp_path, "stuck.py", HOROVOD_RANKS)
    # py-spy attaches in these containers too (root, the same uid as the ranks): the ranks turn it off, as
    # where a site forbids ptrace, and are read through the faulthandler dump their runner armed.
    env = {PY_SPY_ENV: "0"}
    job = Job(session, lambda: run_horovod(train, [str(release), "1"], np=2, cpu=0.5, env=env, session=session), 2)
    job.wait_ready()
    xray = session.xray()
    assert [u.rank for u in xray.units] == [0, 1]
    assert {u.via for u in xray.units} == {"faulthandler"}
    [odd] = xray.odd_ones_out()
    assert odd.rank == 1 and odd.main.innermost_users.function == "wait_for_release"
    assert xray.rank(0).collective == "Horovod allreduce over Gloo"
    assert xray.rank(0).main.innermost_users.source.startswith("total = hvd.allreduce(")
    result = job.finish(release)
    assert result.ok, result.message


@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_an_xray_reads_tensorflow_tasks_in_their_agents(session, tmp_path):
    # Three worker tasks and a parameter server (TF1, between-graph): two workers wait in a session run for
    # a dequeue from a queue on the parameter server, which the third fills once released.
    release = tmp_path / "release"
    tasks = script(tmp_path, "tasks.py", TENSORFLOW_TASKS.replace("RELEASE", str(release)))
    job = Job(
        session, lambda: run_cluster(n_workers=3, n_ps=1, cpu=0.5, memory=1, worker_script=tasks, session=session), 3
    )
    job.wait_ready()
    xray = session.xray()
    assert sorted(u.task for u in xray.units) == ["worker:0", "worker:1", "worker:2"]
    assert {u.via for u in xray.units} == {"agent"}
    [odd] = xray.odd_ones_out()
    assert odd.task == "worker:2" and odd.main.innermost_users.function == "wait_for_release"
    for task in ("worker:0", "worker:1"):
        [waiting] = [u for u in xray.units if u.task == task]
        assert waiting.collective == "TensorFlow's runtime (gRPC), in _call_tf_sessionrun"
        assert (
            waiting.main.innermost_users.source
            == 'print(f"worker {task_index} got", session.run(queue.dequeue()), flush=True)'
        )
    assert xray.quiet == ["w0"]  # the parameter server: only its server's threads
    job.finish(release)
    assert [w["status"] for w in session.list_workers()] == ["stopped", "succeeded", "succeeded", "succeeded"]


TENSORFLOW_TASKS = """\
import os, time
import tensorflow as tf


def wait_for_release(path):
    while not os.path.exists(path):
        time.sleep(0.05)


def run(cluster, server, task_index):
    with tf.Graph().as_default():
        with tf.device("/job:ps/task:0"):
            queue = tf.queue.FIFOQueue(2, tf.float32, shared_name="meet")
        with tf.compat.v1.Session(server.target) as session:
            print(f"worker {task_index} ready", flush=True)
            if task_index == 2:
                wait_for_release("RELEASE")
                session.run(queue.enqueue_many([[1.0, 2.0]]))
            else:
                print(f"worker {task_index} got", session.run(queue.dequeue()), flush=True)
"""
