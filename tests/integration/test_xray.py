"""X-ray of real jobs while they run (issue 38): one rank held back from a collective its peers wait in is
named with its line, the others with the collective; nothing is disturbed, and the job ends well once
the rank is let go. The ranks (PyTorch's four on two local workers, Horovod's in Docker containers) are
read through the faulthandler dump their runner armed, torchrun's own processes with py-spy; TensorFlow's
tasks run in the workers' agents and are read from the agents themselves."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from harness.fixtures import on

from cmlcluster import run_cluster, run_horovod, run_torch
from cmlcluster.events import OutputLine

pytestmark = pytest.mark.integration

# Every rank says it is ready, then all meet in a collective but the held rank, which first waits to be
# released (its "deadlock"): the X-ray must find it at that line, and the others in the collective. It is
# released when the test listens at the address it was given (on the session's side, which workers reach
# on every backend; a file would not reach SSH hosts).
WAIT_FOR_RELEASE = """\
import socket, sys, time


def wait_for_release(address):
    host, port = address.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)

"""
HELD_AT = ("wait_for_release", {"time.sleep(0.05)", "socket.create_connection((host, int(port)), timeout=1).close()"})

TORCH_RANKS = (
    WAIT_FOR_RELEASE
    + """
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
if rank == int(sys.argv[2]):
    wait_for_release(sys.argv[1])
dist.barrier()
print(f"rank {rank} passed", flush=True)
"""
)

HOROVOD_RANKS = (
    WAIT_FOR_RELEASE
    + """
import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
print(f"rank {hvd.rank()} ready", flush=True)
if hvd.rank() == int(sys.argv[2]):
    wait_for_release(sys.argv[1])
total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
print(f"rank {hvd.rank()} sum {float(total[0]):g}", flush=True)
"""
)

# Three worker tasks and a parameter server (TF1, between-graph): two workers wait in a session run for a
# dequeue from a queue on the parameter server, which the third fills once released.
TENSORFLOW_TASKS = (
    WAIT_FOR_RELEASE
    + """
import tensorflow as tf


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
)


class Release:
    """The address a held rank waits at: bound now (a connection is refused), listening once released."""

    def __init__(self, session):
        if session.backend.name == "docker":  # its address on the containers' network comes with its first launch
            session.await_workers(session.launch_workers(1, cpu=0.5, memory=0.5, code="pass"), timeout_seconds=60)
        self.socket = socket.socket()
        self.socket.bind((session.controller_ip, 0))
        self.address = f"{session.controller_ip}:{self.socket.getsockname()[1]}"

    def __call__(self) -> None:
        self.socket.listen(16)


class Job:
    """A run in a thread of its own (it holds the caller as a cell would), its ranks' "ready" lines, and
    the release of its held rank."""

    def __init__(self, session, run, expected_ready: int):
        self.release = Release(session)
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
            self.result = run(self.release.address)
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

    def finish(self, timeout: float = 120):
        self.release()
        try:
            self.thread.join(timeout)
        finally:
            self.release.socket.close()
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.result


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def held(unit) -> bool:
    """Whether a rank's stack stands where the held rank waits."""
    where = unit.main.innermost_users
    function, lines = HELD_AT
    return where.function == function and where.source in lines


@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_an_xray_names_the_torch_rank_held_out_of_a_barrier_and_the_job_ends_well(session, tmp_path):
    train = script(tmp_path, "stuck.py", TORCH_RANKS)
    job = Job(
        session,
        lambda release: run_torch(train, [release, "2"], nnodes=2, nproc_per_node=2, session=session, echo=False),
        4,
    )
    job.wait_ready()
    xray = session.xray()
    assert [u.rank for u in xray.units] == [0, 1, 2, 3] and xray.unanswered == {}
    assert [u.rank for u in xray.odd_ones_out()] == [2], str(xray)
    assert held(xray.rank(2))
    barrier_line = TORCH_RANKS.splitlines().index("dist.barrier()") + 1
    for rank in (0, 1, 3):
        waiting = xray.rank(rank)
        assert waiting.collective == "torch.distributed.barrier"
        assert waiting.main.innermost_users.where == f"stuck.py:{barrier_line}"
    lines = str(xray).splitlines()
    assert (
        lines[1]
        == f"  ranks 0-1, 3: wait in torch.distributed.barrier, at stuck.py:{barrier_line} in <module>: dist.barrier()"
    )
    assert lines[2] == "  odd one out:" and lines[3].startswith("    rank 2 (w")
    assert {u.via for u in xray.units} == {"faulthandler"}  # the dumps the ranks armed
    if session.backend.name == "local":  # the nodes' launchers (torchrun: no dump armed) with py-spy
        assert len(xray.others) == 2 and {p.via for p in xray.others} == {"py-spy"}, str(xray)
    result = job.finish()
    assert result.ok, result.message  # the X-ray disturbed nothing
    assert all(f"rank {r} passed" in "\n".join(result.output[r]) for r in range(4))


@pytest.mark.parametrize("backend", on("docker"), indirect=True)
def test_an_xray_reads_horovod_ranks_in_containers_through_their_dumps(session, tmp_path):
    train = script(tmp_path, "stuck.py", HOROVOD_RANKS)
    job = Job(session, lambda release: run_horovod(train, [release, "1"], np=2, cpu=0.5, session=session), 2)
    job.wait_ready()
    xray = session.xray()
    assert [u.rank for u in xray.units] == [0, 1]
    assert {u.via for u in xray.units} == {"faulthandler"}
    assert [u.rank for u in xray.odd_ones_out()] == [1], str(xray)
    assert held(xray.rank(1))
    assert xray.rank(0).collective.startswith("Horovod allreduce")
    assert xray.rank(0).main.innermost_users.source.startswith("total = hvd.allreduce(")
    result = job.finish()
    assert result.ok, result.message


@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_an_xray_reads_tensorflow_tasks_in_their_agents(session, tmp_path):
    job = Job(
        session,
        lambda release: run_cluster(
            n_workers=3,
            n_ps=1,
            cpu=0.5,
            memory=1,
            worker_script=script(tmp_path, "tasks.py", TENSORFLOW_TASKS.replace("RELEASE", release)),
            session=session,
        ),
        3,
    )
    job.wait_ready()
    xray = session.xray()
    assert sorted(u.task for u in xray.units) == ["worker:0", "worker:1", "worker:2"]
    assert {u.via for u in xray.units} == {"agent"}
    [odd] = xray.odd_ones_out()
    assert odd.task == "worker:2" and held(odd), str(xray)
    for task in ("worker:0", "worker:1"):
        [waiting] = [u for u in xray.units if u.task == task]
        assert waiting.collective == "TensorFlow's runtime (gRPC), in _call_tf_sessionrun"
        assert "session.run(queue.dequeue())" in waiting.main.innermost_users.source
    # The parameter server's worker: only its server's threads run there.
    assert len(xray.quiet) == 1 and xray.quiet[0] not in {u.worker for u in xray.units}
    job.finish()
    # The parameter server is stopped once the workers are done (the last four: docker's first launch is one).
    assert [w["status"] for w in session.list_workers()][-4:] == ["stopped", "succeeded", "succeeded", "succeeded"]
