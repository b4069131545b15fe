"""TF2 parameter-server training with this process as the coordinator, for the tests of lost tasks."""

from __future__ import annotations

import sys
import threading
import traceback


def train_as_coordinator(cluster, epochs, callbacks=()):
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).random((256, 4), dtype=np.float32)

    def data(_context):
        return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1))).repeat().batch(32)

    history = model.fit(
        tf.keras.utils.experimental.DatasetCreator(data),
        epochs=epochs,
        steps_per_epoch=20,
        verbose=0,
        callbacks=list(callbacks),
    )
    return history.history["loss"]


def threads_in_update_server_def():
    """The names of this process's threads inside TensorFlow's Context.update_server_def."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return [
        names.get(ident)
        for ident, frame in sys._current_frames().items()
        if any(
            f.f_code.co_name == "update_server_def" and f.f_code.co_filename.endswith("eager/context.py")
            for f, _ in traceback.walk_stack(frame)
        )
    ]


def stacks_in_update_server_def() -> dict[str, str]:
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    return {
        str(names.get(ident)): "".join(traceback.format_stack(frames[ident]))
        for ident in frames
        if names.get(ident) in threads_in_update_server_def()
    }
