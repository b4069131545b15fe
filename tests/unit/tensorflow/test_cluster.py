"""start_cluster's choices on the fake backend: who becomes a task, carrying on with fewer, failures."""

from __future__ import annotations

import time

import pytest

from cmlcluster import Session, WorkerError, start_cluster
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.errors import CmlClusterError, ConfigError
from cmlcluster.jobs import JobFailed


def fake_session(*plan: FakeWorker) -> Session:
    return Session(FakeBackend(list(plan)), echo=False)


def statuses(session):
    return [w["status"] for w in session.list_workers()]


def test_parameter_servers_come_first_and_never_get_gpus():
    with fake_session() as s:
        cluster = start_cluster(n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, session=s)
        assert cluster.cluster_spec == {"worker": ["10.0.0.2:2323", "10.0.0.3:2323"], "ps": ["10.0.0.1:2323"]}
        assert [(t.job, t.index) for t in cluster.tasks] == [("ps", 0), ("worker", 0), ("worker", 1)]
        assert cluster.session_addr == "grpc://10.0.0.2:2323"
        assert cluster.tf_config("worker", 1)["task"] == {"type": "worker", "index": 1}
        cluster.stop()
        assert statuses(s) == ["stopped"] * 3

    with Session(FakeBackend(gpus=["0", "1"]), echo=False) as s:
        start_cluster(n_workers=2, n_ps=2, cpu=1, memory=1, nvidia_gpu=1, servers=False, session=s)
        assert [w["nvidia_gpu"] for w in s.list_workers()] == [0, 0, 1, 1]


def test_every_task_gets_tf_use_legacy_keras_from_this_process_and_the_users_env(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    backend = FakeBackend()
    with Session(backend, echo=False) as s:
        start_cluster(n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, env={"A": "b"}, session=s)
        envs = [{k: h.spec.env.get(k) for k in ("TF_USE_LEGACY_KERAS", "A")} for h in backend.handles.values()]
    assert envs == [{"TF_USE_LEGACY_KERAS": "1", "A": "b"}] * 3
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")  # the user's env= wins
    with Session(backend := FakeBackend(), echo=False) as s:
        start_cluster(n_workers=1, servers=False, env={"TF_USE_LEGACY_KERAS": "1"}, session=s)
        assert [h.spec.env["TF_USE_LEGACY_KERAS"] for h in backend.handles.values()] == ["1"]


def test_carries_on_with_the_workers_that_started_and_says_so():
    # engine 0: the ps; 1 and 2: workers, of which 2 never comes up.
    with fake_session(FakeWorker(), FakeWorker(), FakeWorker(registers=False)) as s:
        with pytest.warns(UserWarning, match=r"TensorFlow cluster goes on with 2 of 3 workers"):
            cluster = start_cluster(
                n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, min_workers=1, timeout_seconds=0.5, session=s
            )
        assert cluster.cluster_spec == {"worker": ["10.0.0.2:2323"], "ps": ["10.0.0.1:2323"]}
        assert statuses(s) == ["running", "running", "stopped"]  # the late one does not linger


def test_below_min_workers_it_fails_with_the_reasons_and_stops_everything():
    plan = (FakeWorker(), FakeWorker(registers=False), FakeWorker(dies_after=0.05, death_code=3))
    with fake_session(*plan) as s:
        with pytest.raises(CmlClusterError, match=r"only 0 of 2 worker tasks started, fewer than 1") as caught:
            start_cluster(
                n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, min_workers=1, timeout_seconds=1, session=s
            )
        message = str(caught.value)
        assert f"{s.id}-1: worker {s.id}-1 was still scheduling after 1 s" in message
        assert f"{s.id}-2: worker {s.id}-2 exited with code 3" in message
        assert statuses(s) == ["stopped", "stopped", "failed"]


def test_a_missing_parameter_server_is_fatal():
    with fake_session(FakeWorker(launch_error="no room")) as s:
        with pytest.raises(CmlClusterError, match=r"(?s)1 of 1 ps tasks did not start.*no room"):
            start_cluster(n_workers=1, n_ps=1, cpu=1, memory=1, servers=False, timeout_seconds=1, session=s)
        assert statuses(s) == ["stopped"]  # the worker that did start


def test_a_failing_worker_task_names_itself_and_stops_the_cluster():
    plan = (FakeWorker(), FakeWorker(output=("training",)), FakeWorker(output=("ValueError: bad batch",), exit_code=1))
    with fake_session(*plan) as s:
        cluster = start_cluster(n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, session=s)
        with pytest.raises(
            WorkerError, match=r"TensorFlow cluster failed: worker task 1 .* with exit code 1"
        ) as caught:
            cluster.run_script("train")  # a module name: no file needed here
        assert f"worker task 1 (worker {s.id}-2)" in str(caught.value)
        assert "ValueError: bad batch" in str(caught.value)
        assert caught.value.worker_id == f"{s.id}-2"
        assert statuses(s) == ["stopped", "succeeded", "failed"]


def test_bad_input_is_refused_before_anything_starts():
    with fake_session() as s:
        for kwargs, names in [
            ({"n_workers": 0}, "n_workers=0"),
            ({"n_workers": 1, "n_ps": -1}, "n_ps=-1"),
            ({"n_workers": 1, "port": 2222}, "2222"),
            ({"n_workers": 1, "servers": False, "coordinator": True}, "coordinator=True needs servers=True"),
        ]:
            with pytest.raises(ConfigError, match=names):
                start_cluster(cpu=1, memory=1, session=s, **kwargs)
        assert s.list_workers() == []


def test_a_parameter_server_that_dies_fails_the_job_naming_it_and_stops_the_workers():
    plan = (FakeWorker(dies_after=0.3, death_code=-9), FakeWorker(run_time=60), FakeWorker(run_time=60))
    with fake_session(*plan) as s:
        cluster = start_cluster(n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, session=s)
        started = time.monotonic()
        with pytest.raises(JobFailed) as caught:
            cluster.run_script("train")  # a module name: no file needed here
        assert time.monotonic() - started < 5  # not the workers' 60 s
        failure = caught.value.failure
        assert (failure.member.role, failure.member.index, failure.exit_code) == ("ps", 0, -9)
        assert f"ps task 0 (worker {s.id}-0) failed with exit code -9" in str(caught.value)
        assert statuses(s) == ["failed", "stopped", "stopped"]


def test_a_worker_lost_while_this_process_coordinates_fails_the_cluster_and_stops_the_rest():
    plan = (FakeWorker(), FakeWorker(), FakeWorker(dies_after=0.5, death_code=-9))
    with fake_session(*plan) as s:
        with pytest.raises(JobFailed, match=r"worker task 1 .* failed with exit code -9") as caught:
            with start_cluster(n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, session=s) as cluster:
                assert cluster.job.failed.wait(5)  # as model.fit would, fail once the peers are gone
                raise RuntimeError("UnavailableError: the coordinator lost its workers")
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert statuses(s) == ["stopped", "stopped", "failed"]
        # The session goes on: the next cluster works.
        with start_cluster(n_workers=1, cpu=1, memory=1, servers=False, session=s) as again:
            assert again.failure is None


def test_stopping_a_clusters_workers_on_request_does_not_fail_it(caplog):
    with fake_session() as s:
        cluster = start_cluster(n_workers=2, n_ps=1, cpu=1, memory=1, servers=False, session=s)
        s.stop_workers()  # how a user ends a cluster that run_cluster() returned as a spec
        assert cluster.failure is None and not cluster.job.failed.is_set()
        assert "failed" not in caplog.text
        assert statuses(s) == ["stopped", "stopped", "stopped"]


def test_other_users_of_this_machine_are_warned_of_once_per_session_where_tensorflows_servers_run_here():
    import warnings

    from cmlcluster import SharedMachineWarning
    from cmlcluster.backends.base import Capabilities

    with fake_session() as s, warnings.catch_warnings():  # workers elsewhere, no coordinator: nothing to say
        warnings.simplefilter("error", SharedMachineWarning)
        start_cluster(n_workers=1, servers=False, session=s)

    here = Capabilities(own_address=True, session_host=False, python="python3", shared_paths=(), session_machine=True)
    said = []
    for _ in range(2):  # each session says it once, from the same line of the user's code too
        with Session(FakeBackend(capabilities=here), echo=False) as s, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")  # Python's own: once per place where warnings.warn is called
            start_cluster(n_workers=1, servers=False, session=s)
            start_cluster(n_workers=1, servers=False, session=s)
        said += [w for w in seen if w.category is SharedMachineWarning]
    assert len(said) == 2
    assert "every user of this machine" in str(said[0].message) and "the workers' (fake backend)" in str(
        said[0].message
    )
    assert said[0].filename == __file__  # the user's line, not cmlcluster's
