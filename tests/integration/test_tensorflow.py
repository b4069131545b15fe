"""Real TensorFlow clusters on real workers (local processes and Docker containers): parameter-server
training with this process as coordinator, Cloudera's run(cluster, server, task_index) scripts,
MultiWorkerMirroredStrategy, failures and carrying on with fewer workers."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from harness.fixtures import on

from cmlcluster import WorkerError, run_cluster, start_cluster
from cmlcluster.tensorflow import versions

pytestmark = pytest.mark.integration
LONGEST = True  # the default run's longest file: conftest.py starts it first

SCRIPTS = Path(__file__).resolve().parents[2] / "worker_scripts"


def outputs(session):
    return {w["id"]: session.output(w) for w in session.list_workers()}


# Workers at shared addresses (local), on hosts that see none of this folder (ssh), with addresses of their
# own (pods; Docker's containers too, in the matrix tier).
# This process coordinating servers at other machines' addresses: test_tf_restarts' lost replacement on Docker
# containers; SSH hosts and pods here in the matrix tier.
@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_parameter_server_training_with_this_process_as_coordinator(session, capfd):
    # A notebook's TensorFlow logs at INFO (it sees an interactive process); its stopping narrates nothing.
    tf_logger, narrated = logging.getLogger("tensorflow"), Records()
    level = tf_logger.level
    tf_logger.setLevel(logging.INFO)
    tf_logger.addHandler(narrated)
    try:
        train_with_this_process_as_coordinator(session, capfd, narrated)
    finally:
        tf_logger.removeHandler(narrated)
        tf_logger.setLevel(level)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def train_with_this_process_as_coordinator(session, capfd, narrated):
    with start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, session=session) as cluster:
        assert sorted(cluster.cluster_spec) == ["chief", "ps", "worker"]
        assert len(cluster.cluster_spec["worker"]) == 2 and len(cluster.cluster_spec["ps"]) == 1

        # Every task's tf.keras is this process's (on TensorFlow >= 2.16: TF_USE_LEGACY_KERAS).
        legacy = {session.call(t.worker_id, "os:getenv", "TF_USE_LEGACY_KERAS") for t in cluster.tasks}
        assert legacy == {os.environ.get("TF_USE_LEGACY_KERAS")}
        # TensorFlow was preloaded while the workers registered, and the variable asking for it is gone.
        assert {session.call(t.worker_id, "os:getenv", "CMLCLUSTER_PRELOAD") for t in cluster.tasks} == {None}

        strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
        assert strategy.extended._num_workers == 2 and strategy.extended._num_ps == 1
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")

        def dataset(_context):
            x = np.random.default_rng(0).random((512, 4), dtype=np.float32)
            y = x @ np.array([[1.0], [-2.0], [3.0], [0.5]], dtype=np.float32)
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512).repeat().batch(32)

        def cpu_seconds():  # of each worker process, measured there
            return [session.call(t.worker_id, "time:process_time") for t in cluster.workers]

        cpu_before = cpu_seconds()
        history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=4, steps_per_epoch=25)
        cpu_used = [after - before for after, before in zip(cpu_seconds(), cpu_before, strict=True)]
        losses = history.history["loss"]
        assert losses[-1] < losses[0] / 2, losses
        # The variables live on the parameter server, not here and not on the workers.
        assert {v.device for v in model.variables} == {"/job:ps/replica:0/task:0/device:CPU:0"}
        # The steps ran in the worker processes: both worked (their servers are idle otherwise).
        assert all(used > 0.1 for used in cpu_used), cpu_used
    handlers_left = [t for t in threading.enumerate() if t.name == "WorkerPreemptionHandler"]
    assert {w["status"] for w in session.list_workers()} == {"stopped"}
    if session.backend.name != "local":
        return  # what follows is the coordinator's, this process's, whatever the backend

    # Its preemption handler ended within the stop, quietly: not a line later on its own thread (which a
    # notebook showed in the next cell's output).
    assert not handlers_left, handlers_left
    time.sleep(1)
    assert not [m for m in narrated.messages if "failure hand" in m], narrated.messages

    # The coordinator was detached before its servers stopped: freeing its functions logs nothing
    # (TensorFlow used to log "Failed to remove function remotely" per function and task, for minutes).
    capfd.readouterr()
    del model, strategy, history
    gc.collect()
    time.sleep(2)
    assert "Failed to remove function remotely" not in capfd.readouterr().err

    # A notebook re-runs cells: a second cluster in the same process trains too.
    with start_cluster(n_workers=1, n_ps=1, cpu=1, memory=2, session=session) as again:
        strategy = tf.distribute.ParameterServerStrategy(again.resolver)
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        losses = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=3, steps_per_epoch=20)
        assert losses.history["loss"][-1] < losses.history["loss"][0] / 2, losses.history
    del model, strategy
    gc.collect()
    time.sleep(2)
    assert "Failed to remove function remotely" not in capfd.readouterr().err


COORDINATOR_PROCESS = """
import sys, time, numpy as np, tensorflow as tf
import cmlcluster
from cmlcluster import Session, start_cluster
with Session(sys.argv[1], echo=False) as session:
    with start_cluster(n_workers=1, n_ps=1, cpu=1, memory=2, session=session) as cluster:
        strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        x = np.random.default_rng(0).random((256, 4), dtype=np.float32)
        data = lambda _: tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1))).repeat().batch(32)
        model.fit(tf.keras.utils.experimental.DatasetCreator(data), epochs=2, steps_per_epoch=10, verbose=0)
print("stopped", flush=True)
"""


def test_a_process_that_coordinated_training_exits_within_seconds_logging_nothing():
    process = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR_PROCESS, "local"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = process.stdout.readline().strip()
    if line != "stopped":  # it ended (or said something else) before its sessions closed: say how
        _, err = process.communicate(timeout=120)
        raise AssertionError(f"printed {line!r}, exit code {process.returncode}; stderr ends:\n{err[-6000:]}")
    stopped = time.monotonic()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert time.monotonic() - stopped < 10
    assert "Failed to remove function remotely" not in err and "Unable to close remote context" not in err, err


KERAS_FIT = """
import numpy as np, tensorflow as tf
from cmlcluster import Session, start_cluster
from cmlcluster.tensorflow.versions import keras_flavour
print("tf.keras is", keras_flavour(tf), flush=True)
with Session("local", echo=False) as session:
    with start_cluster(n_workers=1, n_ps=1, cpu=0.5, memory=1, session=session) as cluster:
        strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        x = np.ones((64, 4), np.float32)
        dataset = lambda _=None: tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1))).repeat().batch(32)
        keras_2 = keras_flavour(tf) != "keras_3"  # Keras 3 has no DatasetCreator: fit gets a dataset
        data = tf.keras.utils.experimental.DatasetCreator(dataset) if keras_2 else dataset()
        model.fit(data, steps_per_epoch=2, verbose=0)
print("trained", flush=True)
"""


# What this tests is Keras 3's tf.keras (TensorFlow >= 2.16): on .venv-tf2.21, in that venv's own run of this
# file (test_tensorflow_versions.py, itself in the matrix tier), where it is no matrix test. On the default run's
# TensorFlow (2.15, no TF_USE_LEGACY_KERAS) tf.keras is Keras 2 either way, and what it runs there is covered in
# the default run: a coordinator's fit in a child process without TF_USE_LEGACY_KERAS
# (test_a_process_that_coordinated_training_exits_within_seconds_logging_nothing) and keras_flavour's rule
# (tests/unit/tensorflow/test_versions.py). So on 2.15 it is in the matrix tier.
@(pytest.mark.matrix if versions.minor(tf.__version__) < (2, 16) else pytest.mark.integration)
def test_keras_fit_as_coordinator_trains_or_fails_at_once_saying_how_to_get_keras_2():
    """tf.keras as TensorFlow gives it without TF_USE_LEGACY_KERAS: Keras 2 up to 2.15, Keras 3 from 2.16."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    run = subprocess.run([sys.executable, "-c", KERAS_FIT], env=env, capture_output=True, text=True, timeout=180)
    if versions.minor(tf.__version__) < (2, 16):
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == ["tf.keras is keras_2", "trained"]
        assert "Keras 3" not in run.stderr
        return
    assert run.returncode == 1 and run.stdout.splitlines() == ["tf.keras is keras_3"], run.stderr
    major, minor = versions.minor(tf.__version__)
    # Warned as the process became the coordinator, and raised from fit with Keras's own error chained.
    assert run.stderr.count(f"TensorFlow {tf.__version__} gives tf.keras as Keras 3") == 2, run.stderr
    assert f'pip install --no-deps "tf-keras~={major}.{minor}.0"' in run.stderr
    assert "set TF_USE_LEGACY_KERAS=1 before TensorFlow is imported" in run.stderr
    assert "ClusterCoordinator.create_per_worker_dataset" in run.stderr  # Keras's error, the cause
    assert run.stderr.rstrip().splitlines()[-1].startswith("  (Custom training loops")  # ours is the last


# Servers at shared IPs here; at workers' own IPs in the matrix tier (pods) and in test_tf_restarts (containers).
@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_run_cluster_returns_a_spec_and_address_of_real_servers(session):
    spec, address = run_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, session=session)
    assert sorted(spec) == ["ps", "worker"]
    assert address == f"grpc://{spec['worker'][0]}"
    # A TF1 client session through that address places ops on the parameter server.
    with tf.Graph().as_default():
        with tf.device("/job:ps/task:0"):
            total = tf.reduce_sum(tf.constant([1.0, 2.0, 3.0]))
        with tf.compat.v1.Session(address) as client:
            assert client.run(total) == 6.0
            assert {d.name.split("/device")[0] for d in client.list_devices()} >= {
                "/job:ps/replica:0/task:0",
                "/job:worker/replica:0/task:0",
                "/job:worker/replica:0/task:1",
            }
    session.stop_workers()


# The script seen in place; shipped to hosts that do not see it: test_ssh_hosts, and this one in the matrix tier.
@pytest.mark.parametrize("backend", on("local"), indirect=True)
def test_worker_script_runs_cloudera_style_and_stops_everything(session, monkeypatch):
    monkeypatch.setenv("TRAIN_STEPS", "200")
    result = run_cluster(
        n_workers=2, n_ps=1, cpu=1, memory=2, worker_script=str(SCRIPTS / "tf_ps_train.py"), session=session
    )
    assert result == (None, None)
    records = session.list_workers()
    assert [w["status"] for w in records] == ["stopped", "succeeded", "succeeded"]  # ps stopped once done
    logs = outputs(session)
    for task_index, worker in enumerate(records[1:]):
        final = re.search(rf"worker {task_index}: done, (\d+) steps, final loss ([\d.]+)", logs[worker["id"]])
        assert final, logs[worker["id"]]
        assert float(final.group(2)) < 0.05  # it learned the linear function
    # Asynchronous SGD: the two workers' steps add up to the global step count.
    steps = [int(m) for m in re.findall(r"cmlcluster-bench steps=(\d+)", "\n".join(logs.values()))]
    assert len(steps) == 2 and sum(steps) >= 200


@pytest.mark.parametrize("backend", on("local"), indirect=True)  # the strategy's own servers; coordinator: above
def test_multi_worker_mirrored_strategy_ends_with_identical_weights(session):
    # MultiWorkerMirroredStrategy is the allreduce path where Horovod does not build (TensorFlow >= 2.16).
    with start_cluster(n_workers=2, servers=False, cpu=1, memory=2, session=session) as cluster:
        assert "chief" not in cluster.cluster_spec and "ps" not in cluster.cluster_spec
        done = cluster.run_script(str(SCRIPTS / "tf_multiworker_train.py"), args=["--epochs", "2"])
        assert [w["status"] for w in done] == ["succeeded", "succeeded"]
    logs = outputs(session)
    sizes = re.findall(r"task worker:(\d) of (\d)", "\n".join(logs.values()))
    assert sorted(sizes) == [("0", "2"), ("1", "2")]
    checksums = re.findall(r"weights checksum (-?[\d.]+)", "\n".join(logs.values()))
    assert len(checksums) == 2 and checksums[0] == checksums[1]  # the allreduce kept them in step
    # Keras 2 on every worker, as here: Keras 3's fit cannot train across workers (keras-team/keras#20585),
    # so on TensorFlow >= 2.16 the tests set TF_USE_LEGACY_KERAS, which the workers got from the session.
    kerases = set(re.findall(r"TensorFlow \S+, Keras (\d+)\.", "\n".join(logs.values())))
    assert kerases == {"2"}


@pytest.mark.parametrize("backend", on("local"), indirect=True)  # the job layer's; a remote task's death: test_faults
def test_a_raising_worker_script_names_the_worker_and_leaves_nothing(session, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(
        "def run(cluster, server, task_index):\n"
        "    if task_index == 1:\n"
        "        raise ValueError('bad shard ' + str(task_index))\n"
        "    import time; time.sleep(600)\n"
    )
    with pytest.raises(WorkerError) as caught:
        run_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, worker_script=str(script), session=session)
    message = str(caught.value)
    worker_1 = session.list_workers()[2]
    assert f"TensorFlow cluster failed: worker task 1 (worker {worker_1['id']}) failed with exit code 1" in message
    assert "ValueError: bad shard 1" in message and "broken.py" in message
    assert [w["status"] for w in session.list_workers()] == ["stopped", "stopped", "failed"]
    # (the autouse fixture fails the test if any worker process is left)


# A task that prints the TF_CONFIG it was given, without importing TensorFlow (5-7 s of CPU here): what
# min_workers decides is the cluster the tasks are told of. TensorFlow's own reading of a TF_CONFIG and
# its allreduce between tasks: test_multi_worker_mirrored_strategy_ends_with_identical_weights above.
TF_CONFIG_TASK = """\
import os
print("TF_CONFIG", os.environ["TF_CONFIG"], flush=True)
"""


@pytest.mark.parametrize("backend", on("local"), indirect=True)  # the job layer's, on any backend
def test_min_workers_carries_on_without_a_worker_that_never_starts(session, worker_startup_hook, tmp_path):
    # Engine 1, the second worker, hangs before it can register.
    env = worker_startup_hook(
        session.backend, "import os, time\nif os.environ.get('CMLCLUSTER_ENGINE_ID') == '1':\n    time.sleep(3600)\n"
    )
    with pytest.warns(UserWarning, match="goes on with 1 of 2 workers"):
        cluster = start_cluster(
            n_workers=2,
            cpu=1,
            memory=2,
            servers=False,
            min_workers=1,
            timeout_seconds=12,  # how long the never-starting worker is waited for: the other runs in 2 to 5 s
            env=env,
            session=session,
        )
    with cluster:
        assert list(cluster.cluster_spec) == ["worker"] and len(cluster.cluster_spec["worker"]) == 1
        assert [w["status"] for w in session.list_workers()] == ["running", "stopped"]
        script = tmp_path / "tf_config_task.py"
        script.write_text(TF_CONFIG_TASK)
        [done] = cluster.run_script(str(script))
        assert done["status"] == "succeeded"
        spec = cluster.cluster_spec
    [config] = [
        json.loads(line[len("TF_CONFIG ") :]) for line in session.output(done).splitlines() if "TF_CONFIG" in line
    ]
    # The one task that started is told of a cluster of one worker: itself, task 0.
    assert config == {"cluster": spec, "task": {"type": "worker", "index": 0}}
