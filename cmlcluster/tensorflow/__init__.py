"""Distributed TensorFlow on cmlcluster workers: parameter servers, TF_CONFIG, run_cluster.

TensorFlow itself is imported only inside workers and by TFCluster.resolver, so
this package loads (and its builders work) where TensorFlow is not installed.
"""

from .cluster import TaskWorker, TFCluster, run_cluster, start_cluster
from .layout import (
    DEFAULT_PORT,
    Task,
    assign_ports,
    cluster_spec,
    per_gpu_layout,
    session_address,
    spec_from_tasks,
    tf_config,
)

__all__ = [
    "DEFAULT_PORT",
    "TFCluster",
    "Task",
    "TaskWorker",
    "assign_ports",
    "cluster_spec",
    "per_gpu_layout",
    "run_cluster",
    "session_address",
    "spec_from_tasks",
    "start_cluster",
    "tf_config",
]
