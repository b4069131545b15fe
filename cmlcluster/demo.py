"""The main job (``cmlcluster demo``): parameter-server training of a small Keras model.

Local workers by default: parameter servers hold the variables, workers run the
steps, and this process coordinates (TF2's ParameterServerStrategy), as a notebook
would. It prints the workers, the loss epoch by epoch, and the workers stopped.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from .backends import Backend
from .errors import ConfigError
from .tensorflow import versions

TRUE_WEIGHTS = [[1.0], [-2.0], [3.0], [0.5]]


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def workers_table(cluster: Any) -> str:
    records = {w["id"]: w for w in cluster.session.list_workers()}
    rows = [("task", "worker", "status", "address", "exit_code")]
    for task in cluster.tasks:
        w = records[task.worker_id]
        rows.append((f"{task.job} {task.index}", w["id"], w["status"], task.address, str(w["exit_code"])))
    return table(rows)


def run(workers: int, ps: int, epochs: int, backend: str | Backend, timeout: float) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info lines, here and in the tasks
    if importlib.util.find_spec("tf_keras") is not None:  # Keras 2: Keras 3 cannot fit on parameter servers
        os.environ.setdefault(versions.LEGACY_KERAS, "1")
    try:
        import numpy as np
        import tensorflow as tf
    except ImportError:
        raise ConfigError(
            "the main job trains with TensorFlow, which is not installed here: "
            "run `bash scripts/install.sh tensorflow` (or pip install tensorflow-cpu)"
        ) from None
    versions.require_keras_2(tf)
    from . import keras_callback
    from .session import Session
    from .tensorflow import start_cluster

    tf.get_logger().setLevel("ERROR")
    with Session(backend) as session:
        print(
            f"session {session.id}: parameter-server training on {ps} parameter servers and {workers} workers "
            f"({backend} backend); this process coordinates",
            flush=True,
        )
        cluster = start_cluster(
            workers, ps, cpu=0.5, memory=1, session=session, timeout_seconds=timeout,
            env={"TF_CPP_MIN_LOG_LEVEL": os.environ["TF_CPP_MIN_LOG_LEVEL"]},
        )  # fmt: skip
        with cluster:
            print(workers_table(cluster), flush=True)
            strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
            with strategy.scope():
                model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
                model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
            true_weights = np.array(TRUE_WEIGHTS, dtype=np.float32)

            def dataset(context: Any) -> Any:
                x = np.random.default_rng(context.input_pipeline_id).random((1024, 4), dtype=np.float32)
                return tf.data.Dataset.from_tensor_slices((x, x @ true_weights)).shuffle(1024).repeat().batch(32)

            history = model.fit(
                tf.keras.utils.experimental.DatasetCreator(dataset),
                epochs=epochs,
                steps_per_epoch=10,
                verbose=0,
                callbacks=[keras_callback()],
            )
            losses = history.history["loss"]
            print("loss by epoch: " + " ".join(f"{loss:.4f}" for loss in losses), flush=True)
            learned = [round(float(x), 2) for x in model.layers[0].kernel.numpy().ravel()]
            print(f"learned weights {learned}, true {true_weights.ravel().tolist()}", flush=True)
        print(workers_table(cluster), flush=True)
        better = losses[-1] < losses[0]
        print(
            f"stopped; {epochs} epochs on {workers} workers, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + ("" if better else " (it did not go down)"),
            flush=True,
        )
        return 0 if better else 1
