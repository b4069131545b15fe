"""Synchronous data-parallel training with MultiWorkerMirroredStrategy (TensorFlow's own allreduce).

Runs on every worker task with its TF_CONFIG set:

    with cmlcluster.start_cluster(n_workers=2, servers=False) as cluster:
        cluster.run_script("worker_scripts/tf_multiworker_train.py", args=["--epochs", "3"])

Every worker ends with the same weights; it prints their checksum so that can be seen.
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("WARNING")

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
options = parser.parse_args()

task = json.loads(os.environ["TF_CONFIG"])["task"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
n_workers = strategy.num_replicas_in_sync

rng = np.random.default_rng(task["index"])
x = rng.random((1024, 4), dtype=np.float32)
y = x @ np.array([[1.0], [-2.0], [3.0], [0.5]], dtype=np.float32) + 0.25
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(options.batch_size * n_workers)
shard = tf.data.Options()
shard.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = dataset.with_options(shard)

with strategy.scope():
    tf.keras.utils.set_random_seed(0)  # the same initial weights everywhere
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")

history = model.fit(dataset, epochs=options.epochs, steps_per_epoch=options.steps_per_epoch, verbose=0)
losses = history.history["loss"]
checksum = float(sum(np.sum(w) for w in model.get_weights()))
print(f"task {task['type']}:{task['index']} of {n_workers}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
keras = sys.modules[tf.keras.__name__.partition(".")[0]]  # the package behind tf.keras: keras or tf_keras
print(f"task {task['type']}:{task['index']} TensorFlow {tf.__version__}, Keras {keras.__version__}")
print(f"task {task['type']}:{task['index']} weights checksum {checksum:.6f}")
