"""Data-parallel Keras training with Horovod's allreduce, the way the SageMaker article does it:

- hvd.init(); each process sees only its own GPU (local rank);
- the learning rate is scaled by the number of processes;
- DistributedOptimizer averages gradients across processes every step;
- the initial variables are broadcast from rank 0, so every rank starts alike;
- only rank 0 writes checkpoints.

    %horovod -np 2 worker_scripts/horovod_keras_train.py --epochs 3

Under an elastic run (`%horovod --max-restarts N`, which sets HOROVOD_ELASTIC=1 in every rank)
training runs in hvd.elastic.run with a KerasState: a lost rank makes the others roll back to
the state last committed (every --batches-per-commit steps), wait for the new ranks, give them
that state, and go on from its epoch and batch (docs/guide/horovod.md, "Surviving a lost worker").

Every rank prints its rank, size and host, and at the end a checksum of its weights: they are
identical on every rank, because every step applied the same averaged gradients.
"""

import argparse
import os
import socket
import tempfile

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--learning-rate", type=float, default=0.05)
parser.add_argument("--checkpoint-dir", help="keep rank 0's checkpoints here (default: a temporary folder, removed)")
parser.add_argument(
    "--batches-per-commit", type=int, default=5, help="elastic runs: steps between commits of the state"
)
options = parser.parse_args()
elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # horovodrun's elastic mode

hvd.init()
gpus = tf.config.list_physical_devices("GPU")
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
print(f"rank {hvd.rank()} of size {hvd.size()} on host {socket.gethostname()}", flush=True)

# Each rank trains on its own shard of the data.
rng = np.random.default_rng(hvd.rank())
x = rng.random((2048, 8), dtype=np.float32)
y = (x @ np.linspace(-1, 1, 8, dtype=np.float32)[:, None] + 0.5).astype(np.float32)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(2048, seed=hvd.rank()).repeat().batch(options.batch_size)

tf.keras.utils.set_random_seed(hvd.rank())  # different on purpose: the broadcast makes them equal
model = tf.keras.Sequential(
    [tf.keras.Input(shape=(8,)), tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(1)]
)
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(options.learning_rate * hvd.size()))
model.compile(optimizer=optimizer, loss="mse")

losses = []
callbacks = [
    hvd.callbacks.MetricAverageCallback(),
    tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: losses.append(logs["loss"])),
]
if elastic:
    # Every rank, a new one too, must hold the same variables before the state is broadcast: Keras makes
    # the optimizer's on its first step, so make them now (without a step, which would allreduce).
    optimizer.build(model.trainable_variables)
    # The state every rank rolls back to after a loss, and new ranks start from (sent by rank 0).
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_state_reset():  # a new number of ranks: the scaled learning rate follows
        tf.keras.backend.set_value(model.optimizer.learning_rate, options.learning_rate * hvd.size())

    state.register_reset_callbacks([on_state_reset])
    callbacks += [
        hvd.elastic.CommitStateCallback(state, batches_per_commit=options.batches_per_commit),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
    ]
else:
    callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
if hvd.rank() == 0:
    scratch = None if options.checkpoint_dir else tempfile.TemporaryDirectory(prefix="horovod-checkpoints-")
    checkpoint_dir = options.checkpoint_dir or scratch.name  # a temporary one goes when the script ends
    os.makedirs(checkpoint_dir, exist_ok=True)
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "model-{epoch}.keras")))
try:
    import cmlcluster

    callbacks.append(cmlcluster.keras_callback())  # each rank's progress and loss, live in the session
except ImportError:
    pass  # run without cmlcluster: no progress reports


def train(initial_epoch=0):
    model.fit(
        dataset,
        initial_epoch=initial_epoch,
        epochs=options.epochs,
        steps_per_epoch=options.steps_per_epoch,
        callbacks=callbacks,
        verbose=0,
    )


if elastic:
    hvd.elastic.run(lambda state: train(state.epoch))(state)  # again from the committed state after a loss
else:
    train()
checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
if losses:  # none on a rank that joined after the last epoch began
    print(f"rank {hvd.rank()}: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
print(f"rank {hvd.rank()}: weights checksum {checksum:.10f}", flush=True)
