"""What a session listens on, read from the kernel's socket table: nothing where it need not.

The session's own client is in the session's process, so the controller's client channels (every
worker's output, calls to any worker) are on loopback on every backend; only the channels workers
connect to are on the address they reach (the Docker network's gateway here).
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading
import time
from pathlib import Path

import psutil
import pytest
from harness.fixtures import DOCKER_TEST_IMAGE
from harness.horovod_scripts import ALLREDUCE
from harness.processes import own_tree, running

from cmlcluster import Session, run_horovod, run_torch
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.control.connection import ENGINE_CHANNELS

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "worker_scripts"
TORCH_EXAMPLE = EXAMPLES / "torch_ddp_train.py"


def controller_listens_on(session: Session) -> set[tuple[str, int]]:
    """(address, port) of every listening socket of the session's controller (its processes)."""
    processes = running(f"--profile-dir={session.session_dir}/")
    assert processes, "no controller found"
    return {
        (c.laddr.ip, c.laddr.port)
        for p in processes
        for c in p.net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_the_controller_of_a_local_session_listens_on_loopback_only():
    with Session("local", echo=False) as session:
        workers = session.launch_workers(1, cpu=0.5, memory=0.5)
        assert session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)["failures"] == []
        addresses = controller_listens_on(session)
    assert addresses and all(ipaddress.ip_address(ip).is_loopback for ip, _ in addresses), addresses


def test_the_controller_of_a_docker_session_offers_workers_only_their_channels():
    with Session(DockerBackend(image=DOCKER_TEST_IMAGE, host_python=True), echo=False) as session:
        workers = session.launch_workers(1, cpu=0.5, memory=0.5)
        assert session.await_workers(workers, wait_for_completion=False, timeout_seconds=60)["failures"] == []
        gateway = session.controller_ip
        addresses = controller_listens_on(session)
        outside = {(ip, port) for ip, port in addresses if not ipaddress.ip_address(ip).is_loopback}
        # Registration and the engine channels (broadcast counted once per leaf scheduler), on the
        # network's gateway only: never on every interface.
        assert {ip for ip, _ in outside} == {gateway}, addresses
        assert len(outside) == 1 + len(ENGINE_CHANNELS), addresses
        # The client channels and the registration port's second binding are on loopback.
        assert len(addresses) - len(outside) >= 1 + 6, addresses
        # The session's client still reaches every worker through them.
        assert session.call(workers[0], "os:getpid", timeout=30) > 0


class ListenersOutsideLoopback:
    """Samples, in the background, every socket opened to listen outside loopback in this test's process
    tree. Those open before (a TensorFlow coordinator's server that an earlier test left in this process:
    TensorFlow keeps it until the process ends) are not counted."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, int]] = set()
        self._before: set[tuple[str, str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ListenersOutsideLoopback:
        self._before = self._listening()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.seen |= self._listening() - self._before
            self._stop.wait(0.1)

    @staticmethod
    def _listening() -> set[tuple[str, str, int]]:
        found = set()
        for process in [psutil.Process(), *own_tree()]:
            with contextlib.suppress(psutil.Error):
                for c in process.net_connections("inet"):
                    if c.status == psutil.CONN_LISTEN and not ipaddress.ip_address(c.laddr.ip).is_loopback:
                        found.add((" ".join(process.cmdline()[:4]), c.laddr.ip, c.laddr.port))
        return found


# Elastic in the default run: its listeners are static's and the session's rendezvous store.
@pytest.mark.parametrize("max_restarts", [pytest.param(0, marks=pytest.mark.matrix), 1], ids=["static", "elastic"])
def test_a_local_torch_run_listens_on_loopback_only(tmp_path, max_restarts):
    with Session("local", echo=False) as session, ListenersOutsideLoopback() as listeners:
        result = run_torch(
            str(TORCH_EXAMPLE),
            ["--epochs", "2", "--checkpoint-dir", str(tmp_path)],
            nnodes=2,
            nproc_per_node=1,
            cpu=0.5,
            memory=1,
            max_restarts=max_restarts,
            session=session,
            echo=False,
        )
    assert result.ok, result
    # torchrun's rendezvous store would listen on every interface of worker 0 (cmlcluster.pytorch.launch);
    # an elastic run's process-group store, on every interface of rank 0's worker (pytorch/rank.py).
    assert listeners.seen == set()


def test_a_local_horovod_run_listens_on_loopback_only(tmp_path):
    # Ranks that meet through Gloo (hvd.init and an allreduce), whose listeners are what is sampled, without
    # a Keras training on top (the example trains in test_horovod.py and the README).
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    with Session("local", echo=False) as session, ListenersOutsideLoopback() as listeners:
        result = run_horovod(str(script), np=2, session=session, echo=False)
    assert result.ok, result
    assert sorted(
        line.split(" rendezvous")[0] for lines in result.output.values() for line in lines if line.startswith("rank ")
    ) == [
        "rank 0 of 2 sum 3",
        "rank 1 of 2 sum 3",
    ]
    # horovodrun's Gloo rendezvous would listen on every interface (cmlcluster.horovod.driver).
    assert listeners.seen == set()


def test_a_local_tensorflow_cluster_listens_outside_loopback_only_where_tensorflow_binds_every_interface():
    from cmlcluster.tensorflow import start_cluster

    def port(address: str) -> int:
        return int(address.rpartition(":")[2])

    with Session("local", echo=False) as session, ListenersOutsideLoopback() as listeners:
        with start_cluster(n_workers=1, n_ps=1, cpu=0.5, memory=1, session=session) as cluster:
            tasks = {port(a) for job in ("worker", "ps") for a in cluster.cluster_spec[job]}
            every = {port(a) for addresses in cluster.cluster_spec.values() for a in addresses}  # and the chief's
            deadline = time.monotonic() + 30
            while not tasks <= {p for _, _, p in listeners.seen} and time.monotonic() < deadline:
                time.sleep(0.1)  # every task's server listens before start_cluster returns; the sampler lags
    # TensorFlow's gRPC servers bind "0.0.0.0:<port>" themselves (grpc_server_lib.cc) and have no option
    # for an address: they are the only listeners outside loopback, each on its task's port.
    seen = {p for _, _, p in listeners.seen}
    assert tasks <= seen <= every, listeners.seen
