"""What runs inside a worker that is a TensorFlow task. Called by the session through the agent.

The server lives as long as the worker's process: TensorFlow cannot stop a
server, so a cluster ends by stopping its workers.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import runpy
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

_server: Any = None
current_task: str | None = None  # "worker:1": this worker's task, once its server started (an X-ray names it)


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As gRPC binds: connections of an earlier server on this port, closing (TIME_WAIT) on a
        # host that outlives its workers (an SSH host), must not count as "in use".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(
                    f"port {port} is already in use on {socket.gethostname()}; pass another port= to the cluster"
                ) from None
            raise


def start_server(spec: Mapping[str, Sequence[str]], job: str, index: int) -> str:
    """Start this task's tf.distribute.Server (once); returns its target, grpc://..."""
    global _server, current_task
    if _server is not None:
        raise RuntimeError(f"this worker already runs a TensorFlow server ({_server.target})")
    _check_port_free(int(spec[job][index].rpartition(":")[2]))
    import tensorflow as tf

    _server = tf.distribute.Server(
        tf.train.ClusterSpec({k: list(v) for k, v in spec.items()}),
        job_name=job,
        task_index=index,
        protocol="grpc",
        start=True,
    )
    current_task = f"{job}:{index}"
    return str(_server.target)


def _load(script: str) -> dict[str, Any]:
    """A script's globals, run as a module that is not __main__; a module name works too."""
    from ..agent.files import script_path  # in the worker, where the agent runs

    path = script_path(script)  # shipped scripts arrive under a relative name
    if os.path.isfile(path):
        return runpy.run_path(path, run_name="__cmlcluster_task__")
    return vars(importlib.import_module(script))


def run_cml_script(script: str, spec: Mapping[str, Sequence[str]], task_index: int) -> Any:
    """Cloudera's convention: the script defines run(cluster, server, task_index); worker tasks call it."""
    if _server is None:
        raise RuntimeError("no TensorFlow server runs in this worker; start_server must come first")
    run = _load(script).get("run")
    if not callable(run):
        raise RuntimeError(f"{script} defines no run(cluster, server, task_index) function")
    import tensorflow as tf

    return run(tf.train.ClusterSpec({k: list(v) for k, v in spec.items()}), _server, task_index)


def run_script(script: str, tf_config: Mapping[str, Any], args: Sequence[str] = ()) -> None:
    """Run a script as __main__ with this task's TF_CONFIG, as `TF_CONFIG=... python script args` would."""
    from ..agent.files import script_path

    os.environ["TF_CONFIG"] = json.dumps(tf_config)
    path = script_path(script)
    sys.argv = [path, *args]
    if os.path.isfile(path):
        runpy.run_path(path, run_name="__main__")
    else:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
