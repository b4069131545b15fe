"""The pure TensorFlow builders, checked against TensorFlow's own ClusterSpec and TF_CONFIG resolver."""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

from cmlcluster.errors import ConfigError
from cmlcluster.tensorflow import layout


def test_cluster_spec_and_tf_config_match_what_tensorflow_reads(monkeypatch):
    spec = layout.cluster_spec(
        ps=["10.0.0.1:2323", "10.0.0.2:2323"], workers=["10.0.0.3:2323", "10.0.0.4:2323"], chief=["10.0.0.9:2323"]
    )
    assert spec == {
        "chief": ["10.0.0.9:2323"],
        "worker": ["10.0.0.3:2323", "10.0.0.4:2323"],
        "ps": ["10.0.0.1:2323", "10.0.0.2:2323"],
    }
    assert tf.train.ClusterSpec(spec).as_dict() == spec
    assert layout.session_address(spec) == "grpc://10.0.0.9:2323"
    assert layout.session_address({"worker": ["10.0.0.3:2323"]}) == "grpc://10.0.0.3:2323"

    for task_type, index in [("worker", 1), ("ps", 0), ("chief", 0)]:
        config = layout.tf_config(spec, task_type, index)
        monkeypatch.setenv("TF_CONFIG", json.dumps(config))
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert (resolver.task_type, resolver.task_id) == (task_type, index)
        assert resolver.cluster_spec().as_dict() == spec
        assert resolver.master(rpc_layer="grpc") == f"grpc://{spec[task_type][index]}"


def test_ports_default_to_2323_and_tasks_sharing_an_ip_get_their_own():
    assert layout.assign_ports(["10.0.0.1", "10.0.0.2"]) == [2323, 2323]
    assert layout.assign_ports(["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.1"]) == [2323, 2324, 2323, 2325]
    assert layout.assign_ports(["h", "h", "h"], port=5000) == [5000, 5001, 5002]
    # 2222 is sshd's in every worker: never handed out.
    assert layout.assign_ports(["h", "h", "h"], port=2221) == [2221, 2223, 2224]


def test_per_gpu_layout_one_ps_per_host_and_one_worker_per_gpu():
    tasks = layout.per_gpu_layout(["10.0.0.1", "10.0.0.2"], gpus_per_host=2)
    assert [(t.job, t.index, t.address, dict(t.env)) for t in tasks] == [
        ("ps", 0, "10.0.0.1:2323", {}),
        ("worker", 0, "10.0.0.1:2324", {"CUDA_VISIBLE_DEVICES": "0"}),
        ("worker", 1, "10.0.0.1:2325", {"CUDA_VISIBLE_DEVICES": "1"}),
        ("ps", 1, "10.0.0.2:2323", {}),
        ("worker", 2, "10.0.0.2:2324", {"CUDA_VISIBLE_DEVICES": "0"}),
        ("worker", 3, "10.0.0.2:2325", {"CUDA_VISIBLE_DEVICES": "1"}),
    ]
    spec = layout.spec_from_tasks(tasks)
    assert spec["ps"] == ["10.0.0.1:2323", "10.0.0.2:2323"]
    assert tf.train.ClusterSpec(spec).num_tasks("worker") == 4


def test_ipv6_addresses_are_bracketed():
    assert layout.join_address("fd00::2", 2323) == "[fd00::2]:2323"
    assert layout.split_address("[fd00::2]:2323") == ("fd00::2", 2323)


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: layout.check_counts(n_workers=0, n_ps=1), "n_workers=0"),
        (lambda: layout.check_counts(n_workers=2, n_ps=-1), "n_ps=-1"),
        (lambda: layout.check_counts(n_workers=2, n_ps=1, min_workers=3), "min_workers=3"),
        (lambda: layout.check_counts(n_workers=2, n_ps=True), "n_ps=True"),
        (lambda: layout.assign_ports(["h"], port=2222), "2222"),
        (lambda: layout.assign_ports(["h"], port=70000), "port=70000"),
        (lambda: layout.cluster_spec(ps=["10.0.0.1:2323"], workers=["10.0.0.1:2323"]), "10.0.0.1:2323"),
        (lambda: layout.cluster_spec(ps=["10.0.0.1:2323"]), "at least one worker"),
        (lambda: layout.cluster_spec(workers=["10.0.0.1"]), "'10.0.0.1'"),
        (lambda: layout.cluster_spec(workers=["10.0.0.1:2222"]), "2222"),
        (lambda: layout.tf_config({"worker": ["a:1"]}, "ps", 0), "task_type='ps'"),
        (lambda: layout.tf_config({"worker": ["a:1"]}, "worker", 1), "task_index=1"),
        (lambda: layout.per_gpu_layout(["h", "h"], 1), "h listed twice"),
        (lambda: layout.per_gpu_layout(["h"], 0), "gpus_per_host=0"),
        (lambda: layout.spec_from_tasks([layout.Task("worker", 1, "h:1")]), "0..0"),
        (lambda: layout.spec_from_tasks([layout.Task("evaluator", 0, "h:1")]), "'evaluator'"),
    ],
)
def test_bad_input_names_the_value_and_the_fix(call, names):
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace(".", r"\.")):
        call()
