"""TensorFlow parameter-server training (this process coordinating) that loses a worker task and is given
it back (start_cluster's max_restarts): what the loss costs, beside a fresh start, in one run.

Each repeat, in a session whose controller already runs: start_cluster(2 workers, 1 ps, max_restarts=1)
and Keras fit as the coordinator. Measured:

- fresh start: the call to start_cluster -> the first epoch's end (workers launched, servers up,
  the strategy connected, the first steps);
- kill -> replacement running: kill -9 of task 1's agent after the third epoch, to the job's
  member_replaced (the loss seen, a worker launched in its place, its server at the lost address);
- kill -> taken back: to TensorFlow's coordinator having the task again (its preemption handler's
  wait over), polled every 50 ms;
- steps a second: the epochs before the kill, and those while task 1 was away (training never stops:
  the other worker carries on), so the dip is the loss of one worker of two.

    python bench/tf_recovery.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
import traceback

from repeats import medians  # bench/, the script's folder

from cmlcluster import Session, start_cluster
from cmlcluster.events import JobChanged

STEPS_PER_EPOCH = 20
KILL_AFTER_EPOCH = 3
EPOCHS_AFTER_BACK = 3


def recovering() -> bool:
    """Whether a thread of TensorFlow's coordinator is taking a lost task back (bench/tests share the idea)."""
    for frame in sys._current_frames().values():
        functions = {f.f_code.co_name for f, _ in traceback.walk_stack(frame)}
        if functions & {"_wait_for_lost_tasks", "update_server_def"} and "_park_for_good" not in functions:
            return True
    return False


def once() -> dict[str, float]:
    import numpy as np
    import tensorflow as tf

    with Session("local", echo=False) as session:
        warm = session.launch_workers(1, 0.5, 0.5)  # the controller up first: the start measured is the cluster's
        session.await_workers(warm, wait_for_completion=False, timeout_seconds=60)
        times: dict[str, float] = {}
        session.subscribe(
            lambda e: (
                times.setdefault("replaced", time.monotonic())
                if isinstance(e, JobChanged) and e.state == "member_replaced"
                else None
            )
        )
        started = time.monotonic()
        with start_cluster(n_workers=2, n_ps=1, cpu=1, memory=2, max_restarts=1, session=session) as cluster:
            epochs: list[tuple[float, float]] = []  # (start, end) of each epoch

            def watch_back() -> None:
                while "replaced" not in times or recovering():
                    time.sleep(0.05)
                times["back"] = time.monotonic()

            class Timeline(tf.keras.callbacks.Callback):
                def on_epoch_begin(self, epoch, logs=None):
                    self.began = time.monotonic()

                def on_epoch_end(self, epoch, logs=None):
                    now = time.monotonic()
                    epochs.append((self.began, now))
                    times.setdefault("first", now)
                    if epoch + 1 == KILL_AFTER_EPOCH:
                        os.kill(session.worker_pid(cluster.workers[1].worker_id), signal.SIGKILL)
                        times["killed"] = time.monotonic()
                        threading.Thread(target=watch_back, daemon=True).start()
                    if "back" in times and now > times["back"] and not hasattr(self, "after"):
                        self.after = epoch + EPOCHS_AFTER_BACK
                    if getattr(self, "after", None) == epoch:
                        self.model.stop_training = True

            strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
            with strategy.scope():
                model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
                model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
            x = np.random.default_rng(0).random((256, 4), dtype=np.float32)

            def data(_context):
                return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1))).repeat().batch(32)

            model.fit(
                tf.keras.utils.experimental.DatasetCreator(data),
                epochs=1000,
                steps_per_epoch=STEPS_PER_EPOCH,
                verbose=0,
                callbacks=[Timeline()],
            )
            assert cluster.restarts == 1 and cluster.failure is None
    before = [STEPS_PER_EPOCH / (end - begin) for begin, end in epochs[1:KILL_AFTER_EPOCH]]
    away = [STEPS_PER_EPOCH / (end - begin) for begin, end in epochs if times["killed"] < begin and end < times["back"]]
    return {
        "fresh": times["first"] - started,
        "replaced": times["replaced"] - times["killed"],
        "back": times["back"] - times["killed"],
        "rate_before": statistics.median(before),
        "rate_away": statistics.median(away) if away else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    m = medians(
        once,
        args.repeat,
        lambda run: (
            f"fresh start {run['fresh']:5.1f} s   kill -> replacement running {run['replaced']:5.1f} s   "
            f"kill -> taken back {run['back']:5.1f} s   steps/s {run['rate_before']:.0f} before, "
            f"{run['rate_away']:.0f} while away"
        ),
    )
    print(
        f"medians of {args.repeat}: fresh start {m['fresh']:.1f} s, kill -> replacement running {m['replaced']:.1f} s, "
        f"kill -> taken back {m['back']:.1f} s (ratio to a fresh start {m['back'] / m['fresh']:.2f}); "
        f"steps/s while away {m['rate_away'] / m['rate_before']:.2f} of before"
    )


if __name__ == "__main__":
    main()
