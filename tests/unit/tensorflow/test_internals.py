"""TensorFlow's private names that cmlcluster reads (tensorflow/internals.py), probed on the TensorFlow
installed here: 2.15 in the main environment, 2.21 through test_tensorflow_versions.py."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from cmlcluster.errors import CmlClusterError  # noqa: E402
from cmlcluster.tensorflow import internals  # noqa: E402


def test_every_private_name_is_where_cmlcluster_reads_it_on_this_tensorflow():
    internals._probed = None
    internals.probe()  # raises, naming the version and what is missing, otherwise
    assert internals._probed == tf.__version__


def test_a_renamed_name_is_an_error_naming_the_version_and_the_name(monkeypatch):
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    def renamed(self):  # a TensorFlow whose queue no longer has _error
        self._queue_lock = None
        self._stop_waiting_condition = None

    monkeypatch.setattr(cluster_coordinator._CoordinatedClosureQueue, "__init__", renamed)
    monkeypatch.setattr(internals, "_probed", None)
    with pytest.raises(CmlClusterError) as caught:
        internals.probe()
    message = str(caught.value)
    assert f"TensorFlow {tf.__version__}" in message and "_CoordinatedClosureQueue's _queue_lock, _error" in message
    assert "Worker._cluster" not in message  # only what is missing is named
