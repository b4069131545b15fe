"""Parameter-server training, Cloudera's way: every worker task calls run(cluster, server, task_index).

    cdsw.run_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, worker_script="worker_scripts/tf_ps_train.py")

The model is a linear regression on synthetic data, trained with asynchronous
SGD: variables live on the parameter servers (replica_device_setter), each
worker computes gradients on its own batches and applies them there.

Started by hand it works the same way, from TF_CONFIG:

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' python tf_ps_train.py

Environment: TRAIN_STEPS (global steps, default 300), BATCH_SIZE (default 64).
"""

import json
import os
import time

import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("WARNING")
v1 = tf.compat.v1

TRUE_WEIGHTS = np.array([[1.0], [-2.0], [3.0], [0.5]], dtype=np.float32)
TRUE_BIAS = 0.25


def batches(task_index, batch_size):
    rng = np.random.default_rng(task_index)
    while True:
        x = rng.random((batch_size, 4), dtype=np.float32)
        yield x, x @ TRUE_WEIGHTS + TRUE_BIAS


def wait_for_chief(target, config):
    """A non-chief MonitoredTrainingSession checks every 30 s whether the chief has initialized the
    variables: in a short job it starts after the chief is done. Asking every 0.1 s here, it starts
    with the chief."""
    uninitialized = v1.report_uninitialized_variables()
    with v1.Session(target, config=config) as session:
        while len(session.run(uninitialized)):
            time.sleep(0.1)


def run(cluster, server, task_index):
    steps = int(os.environ.get("TRAIN_STEPS", "300"))
    batch_size = int(os.environ.get("BATCH_SIZE", "64"))
    with tf.Graph().as_default():
        setter = v1.train.replica_device_setter(worker_device=f"/job:worker/task:{task_index}", cluster=cluster)
        with v1.device(setter):
            global_step = v1.train.get_or_create_global_step()
            x = v1.placeholder(tf.float32, [None, 4])
            y = v1.placeholder(tf.float32, [None, 1])
            w = v1.get_variable("w", [4, 1], initializer=v1.zeros_initializer())
            b = v1.get_variable("b", [1], initializer=v1.zeros_initializer())
            loss = tf.reduce_mean(tf.square(x @ w + b - y))
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step)
        # Talk only to the parameter servers and this worker, so no worker waits for another.
        config = v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{task_index}"])
        hooks = [v1.train.StopAtStepHook(last_step=steps)]
        data = batches(task_index, batch_size)
        if task_index != 0:
            wait_for_chief(server.target, config)
        local_steps, started, started_at, last = 0, None, None, None
        with v1.train.MonitoredTrainingSession(
            master=server.target, is_chief=task_index == 0, hooks=hooks, config=config
        ) as session:
            while not session.should_stop():
                bx, by = next(data)
                _, last, step = session.run([train, loss, global_step], feed_dict={x: bx, y: by})
                if started is None:
                    started, started_at = time.perf_counter(), time.time()
                local_steps += 1
                if local_steps % 100 == 0:
                    print(f"worker {task_index}: global step {step}, loss {last:.4f}", flush=True)
            finished_at = time.time()
        elapsed = time.perf_counter() - (started or time.perf_counter())
    print(f"worker {task_index}: done, {local_steps} steps, final loss {last:.4f}", flush=True)
    # For bench/tf_cluster.py: the cluster's throughput is all steps over the span from the first
    # worker's first step to the last worker's last (wall clock: the workers share a clock there).
    print(
        f"cmlcluster-bench steps={local_steps} seconds={elapsed:.4f} "
        f"from={started_at or finished_at:.4f} to={finished_at:.4f}",
        flush=True,
    )
    return last


if __name__ == "__main__":
    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    cluster = tf.train.ClusterSpec(config["cluster"])
    server = tf.distribute.Server(cluster, job_name=task["type"], task_index=task["index"], protocol="grpc")
    if task["type"] == "ps":
        server.join()
    else:
        run(cluster, server, task["index"])
