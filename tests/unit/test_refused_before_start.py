"""Values no worker could ever run with are refused before anything starts: a TensorFlow cluster's missing
script (run_cluster, `cmlcluster run-cluster`), cpu=/memory= beyond the machine local workers run on."""

from __future__ import annotations

import pytest

from cmlcluster import ConfigError, Session
from cmlcluster.__main__ import main
from cmlcluster.backends.fake import FakeBackend
from cmlcluster.backends.local import LocalBackend
from cmlcluster.resources import check_fits_machine
from cmlcluster.tensorflow import run_cluster
from cmlcluster.tensorflow.cluster import check_script
from cmlcluster.workers import Resources


@pytest.fixture
def session():
    with Session(FakeBackend(), echo=False) as s:
        yield s


def test_run_cluster_refuses_a_missing_worker_script_before_any_worker_starts(session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"worker_script='no_such_train\.py': no such file in "):
        run_cluster(1, 1, 1, 1, worker_script="no_such_train.py", session=session)
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller


def test_the_cli_refuses_a_missing_script_before_the_session_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def no_session(*args, **kwargs):
        raise AssertionError("a session was made for a script that does not exist")

    monkeypatch.setattr("cmlcluster.session.Session", no_session)
    assert main(["run-cluster", "missing/train.py", "--backend", "fake"]) == 2
    assert "cmlcluster run-cluster: script='missing/train.py': no such file" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["train.py", "folder/train.py", "not a module", "train-2", ""])
def test_a_script_that_is_no_file_here_and_no_module_name_is_refused(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"script={script!r}: (no such file|give the path of a file)"):
        check_script(script)


def test_a_file_or_a_module_name_is_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("def run(cluster, server, task_index): pass\n")
    assert check_script("train.py") == str(tmp_path / "train.py")
    assert check_script(str(tmp_path / "train.py")) == str(tmp_path / "train.py")
    # A module name travels as it is: the workers import it, and may have it where this process does not.
    assert check_script("mypackage.train") == "mypackage.train"


@pytest.mark.parametrize(
    "resources, message",
    [
        (Resources(cpu=3, memory=1), r"cpu=3: this machine has 2 CPUs for local workers; ask for at most cpu=2"),
        (Resources(cpu=2.5, memory=1), r"cpu=2\.5: this machine has 2 CPUs"),
        (Resources(cpu=1, memory=64), r"memory=64: this machine has 7\.8 GB of memory in all"),
    ],
)
def test_cpu_or_memory_beyond_the_machine_is_refused_naming_what_it_has(resources, message):
    with pytest.raises(ConfigError, match=message):
        check_fits_machine(resources, cpus=2, memory_gb=7.8)


def test_what_the_machine_has_is_taken():
    check_fits_machine(Resources(cpu=2, memory=7.8), cpus=2, memory_gb=7.8)
    check_fits_machine(Resources(cpu=2, memory=512), cpus=2, memory_gb=None)  # the OS does not say: taken


def test_the_local_backend_refuses_more_cpu_than_the_machine_has_before_anything_starts(monkeypatch):
    monkeypatch.setattr("cmlcluster.backends.local.machine_cpus", lambda: 2)

    async def no_attach(self, context):
        raise AssertionError("the session started for a worker that can never run here")

    monkeypatch.setattr(LocalBackend, "attach", no_attach)  # the first thing a launch starts
    with Session(LocalBackend(gpus=[]), echo=False) as session:
        with pytest.raises(ConfigError, match=r"cpu=3: this machine has 2 CPUs"):
            session.launch_workers(1, cpu=3, memory=1)
        with pytest.raises(ConfigError, match=r"memory=100000: this machine has [0-9.]+ GB of memory"):
            session.launch_workers(1, cpu=1, memory=100000)
        assert session.list_workers() == []


def test_a_running_clusters_missing_script_is_refused_and_the_cluster_kept(session, tmp_path, monkeypatch):
    from cmlcluster.tensorflow import start_cluster

    monkeypatch.chdir(tmp_path)
    cluster = start_cluster(1, 0, servers=False, session=session)
    with cluster:
        with pytest.raises(ConfigError, match=r"script='tf_train\.py': no such file"):
            cluster.run_script("tf_train.py")
        assert not cluster.stopped  # a typo costs no new cluster


def _script(tmp_path):
    (tmp_path / "train.py").write_text("print('training')\n")
    return str(tmp_path / "train.py")


@pytest.mark.parametrize(
    "run, kwargs, message",
    [
        ("torch", {"cpu": "two"}, r"cpu='two': cpu must be a number greater than 0"),
        ("torch", {"memory": 0}, r"memory=0: memory \(GB\) must be a number greater than 0"),
        ("horovod", {"nvidia_gpu": 1.5}, r"nvidia_gpu=1.5: must be a whole number of GPUs"),
        ("horovod", {"start_timeout": 0}, r"start_timeout=0: give whole seconds, 1 or more"),
        ("horovod", {"ssh_port": 70000}, r"ssh_port=70000: give the TCP port sshd listens on"),
        ("cluster", {"cpu": -1}, r"cpu=-1: cpu must be a number greater than 0"),
        ("cluster", {"timeout_seconds": -5}, r"timeout_seconds=-5: give the seconds the workers have to start"),
    ],
)
def test_every_run_refuses_resources_and_timeouts_no_worker_could_have_before_anything_starts(
    session, tmp_path, monkeypatch, run, kwargs, message
):
    from cmlcluster import run_horovod, run_torch, start_cluster

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        if run == "torch":
            run_torch(_script(tmp_path), session=session, **kwargs)
        elif run == "horovod":
            run_horovod(_script(tmp_path), session=session, **kwargs)
        else:
            start_cluster(1, 1, session=session, **kwargs)
    assert session.list_workers() == []
    assert not session.backend.control.started  # not even the controller
