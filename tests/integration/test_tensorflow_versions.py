"""The TensorFlow tests again, on the newest TensorFlow: 2.21 in .venv-tf2.21 (scripts/install.sh dev): the
probes of its private names in the default run, the training and fault tests in the matrix tier.

The coordinator of parameter-server training is the test process itself, so these tests run in that
venv's own pytest: test_tensorflow.py on local workers, and the faults of test_faults.py that involve
TensorFlow and not Horovod (which does not build against TensorFlow >= 2.16). tf.keras is tf_keras
there (TF_USE_LEGACY_KERAS=1), as the fix cmlcluster gives users says; what Keras 3 does is
test_keras_fit_as_coordinator_trains_or_fails_at_once_saying_how_to_get_keras_2, in a child process.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NEWEST = "2.21.0"
VENV = ROOT / ".venv-tf2.21"
# The TensorFlow tests that run on the newest version too: the probes of its private names in the default run,
# the training and fault tests in the matrix tier (the default run trains on the TensorFlow the main job pins).
PROBES = ["tests/unit/tensorflow/test_versions.py", "tests/unit/tensorflow/test_internals.py"]
TRAINING = [
    "tests/integration/test_tensorflow.py",
    "tests/integration/test_faults.py::test_kill_9_of_a_worker_while_this_process_coordinates_fails_fit_and_the_next_cluster_trains",
    "tests/integration/test_faults.py::test_kill_9_of_a_parameter_server_while_this_process_coordinates",
]
# The version is what this run tests: on local workers. The other backends run the same tests with the
# main TensorFlow; what they change (where a task runs) does not depend on TensorFlow's version. Nor
# does the job layer's: going on without a worker that never started, and failing a job whose task
# died under a TF1 script. Nor do restarts: the TensorFlow they rely on (the coordinator taking a worker
# back) is probed on this version by test_tf_internals.py, and the restarts run on the main TensorFlow.
# Nor do a raising script's report and run_cluster's returned spec (the job layer's; the servers they
# start are the PS training's too).
BACKENDS = [
    "-k",
    "not docker and not ssh and not kubernetes and not min_workers and not during_run_cluster"
    " and not raising_worker_script and not returns_a_spec",
]


def test_the_probes_of_tensorflows_private_names_pass_on_the_newest_tensorflow(tmp_path):
    assert pytest_on_newest(tmp_path, PROBES) >= 10


@pytest.mark.matrix
@pytest.mark.timeout(2400)
def test_the_tensorflow_tests_pass_on_the_newest_tensorflow(tmp_path):
    assert pytest_on_newest(tmp_path, [*BACKENDS, *TRAINING]) >= 7  # the local ones BACKENDS leaves


def pytest_on_newest(tmp_path: Path, arguments: list[str]) -> int:
    """Run these tests in the newest TensorFlow's venv (its own pytest); how many passed. Nothing may fail,
    be skipped or error."""
    python = VENV / "bin" / "python"
    assert python.exists(), f"{VENV} is missing: scripts/install.sh dev makes it"
    probe = "import tensorflow as tf, tf_keras; print(tf.__version__, tf_keras.__version__)"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert found == [NEWEST, NEWEST]

    # A run of its own (conftest.py), in one process: this run's other worker uses the other core.
    env = {k: v for k, v in os.environ.items() if k not in ("CMLCLUSTER_TESTS_ROOT", "PYTEST_XDIST_WORKER")}
    env["TF_USE_LEGACY_KERAS"] = "1"
    log = tmp_path / "pytest.log"  # the whole run, for a failure's message
    with log.open("w") as out:
        run = subprocess.run(
            [
                python,
                "-m",
                "pytest",
                "-n",
                "0",
                "-p",
                "no:cacheprovider",
                f"--basetemp={tmp_path / 'inner'}",
                *arguments,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=2300,
        )
    text = log.read_text()
    # pytest's last line of its own; TensorFlow may log after it, at exit (a coordinator of a failed cluster
    # logs "Failed to remove function remotely" for each function it frees).
    summary = re.findall(r"^=+ (.* in [\d.]+s.*) =+$", text, re.M)[-1]
    assert run.returncode == 0, text[-30000:]
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (\w+)", summary))
    assert not set(counts) - {"passed", "deselected", "warning", "warnings"}, summary
    return counts.get("passed", 0)
