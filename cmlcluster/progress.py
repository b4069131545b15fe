"""Training progress: report(step=..., **metrics) from anywhere training runs.

In a worker, a Horovod rank or a TensorFlow task, a report is one marked line on
stdout: it travels with the worker's output (through ipyparallel, or horovodrun's
relay), and the session turns it back into a Progress event instead of showing it.
In the session's own process (a coordinator, the notebook's training loop), it is
published to the session directly. Anywhere else it is a readable line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from . import live, wire
from .errors import ConfigError
from .events import OutputLine, Progress

MARKER = "@cmlcluster-progress "  # a line starting with this (after any prefix) is a report


def report(
    step: float, total: float | None = None, *, task: str | None = None, session: Any = None, **metrics: float
) -> None:
    """Report a training step (`total` steps in all, if known) and its metrics (numbers), e.g. loss=0.3.

    task names the reporter in the UI; by default the Horovod or PyTorch rank, the TensorFlow task
    (from TF_CONFIG), "coordinator" in the session's process, or the worker's id. In the
    session's process, the report goes to `session`, by default the newest open one.
    """
    progress = make_progress(step, total, task, metrics)
    if _in_worker():
        print(MARKER + encode(progress), flush=True)
        return
    if session is None:
        session = live.newest()
    if session is not None:
        session.publish(progress)
    else:
        print(f"{progress.task}: {describe(progress)}", flush=True)


def make_progress(step: Any, total: Any, task: str | None, metrics: Mapping[str, Any]) -> Progress:
    """A Progress from report()'s arguments, refused with the bad value named when they are not numbers."""
    step = _number("step", step)
    total = None if total is None else _number("total", total)
    clean = {name: _number(name, value) for name, value in metrics.items()}
    return Progress(task=task or _task_name(), step=step, total=total, metrics=clean)


def _number(name: str, value: Any) -> float:
    try:
        number = float(value)  # numpy scalars and 0-d tensors too
    except (TypeError, ValueError):
        raise ConfigError(f"report({name}={value!r}): give a number") from None
    if isinstance(value, bool):
        raise ConfigError(f"report({name}={value!r}): give a number, not a bool")
    return number


def _horovod_rank() -> str | None:
    """The rank Horovod gives this process now, where it runs: an elastic run numbers its ranks again at
    each reset, while HOROVOD_RANK keeps the one the process started with (a survivor and the rank that
    joined after a loss both reported as "rank 1", seen in bench/horovod_recovery.py)."""
    for name in ("horovod.tensorflow", "horovod.torch"):  # horovod.keras and tensorflow.keras use the first
        module = sys.modules.get(name)
        if module is None:
            continue
        try:
            return str(int(module.rank()))
        except Exception:  # noqa: S112 - not initialized (yet, or any more): the environment's
            continue
    return None


def _in_worker() -> bool:
    """Whether this process's stdout reaches a session: a worker (or its children), or a rank horovodrun relays.

    Not CDSW_ENGINE_ID: CML sets it in the notebook's own session too.
    """
    return any(name in os.environ for name in (wire.ENGINE_ID_ENV, "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"))


def _task_name() -> str:
    rank = _horovod_rank() or os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    if rank is None and "TORCHELASTIC_RUN_ID" in os.environ:  # a process torchrun started
        rank = os.environ.get("RANK")
    if rank is not None:
        return f"rank {rank}"
    tf_config = os.environ.get("TF_CONFIG")
    if tf_config:
        try:
            task = json.loads(tf_config)["task"]
            return f"{task['type']} {task['index']}"
        except (ValueError, KeyError, TypeError):
            pass
    return "" if _in_worker() else "coordinator"  # "": the session names it after the worker


def encode(progress: Progress) -> str:
    return json.dumps(
        {"task": progress.task, "step": progress.step, "total": progress.total, "metrics": dict(progress.metrics)},
        allow_nan=True,
    )


def decode(line: str, source: str) -> Progress | None:
    """The Progress in a marked output line of `source` (a worker id), or None if it is not one."""
    start = line.find(MARKER)
    if start < 0:
        return None
    try:
        data = json.loads(line[start + len(MARKER) :])
        return Progress(
            task=data.get("task") or source,
            step=float(data["step"]),
            total=None if data.get("total") is None else float(data["total"]),
            metrics={str(k): float(v) for k, v in (data.get("metrics") or {}).items()},
            time=time.time(),
            worker=source,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # a line that merely mentions the marker stays output


def output_event(source: str, stream: str, text: str) -> OutputLine | Progress:
    """A line of output from `source`: the Progress it reports, or the line itself."""
    progress = decode(text, source) if MARKER in text else None
    return progress if progress is not None else OutputLine(source, stream, text)


def describe(progress: Progress) -> str:
    """`step 30/100 loss=0.412`: a report as text."""
    step = f"{progress.step:g}" + (f"/{progress.total:g}" if progress.total is not None else "")
    metrics = " ".join(f"{k}={_short(v)}" for k, v in progress.metrics.items())
    return f"step {step}" + (f" {metrics}" if metrics else "")


def _short(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def keras_callback(every_seconds: float = 0.5) -> Any:
    """A Keras callback that reports each epoch, and batches at most every `every_seconds`
    (epochs only under ParameterServerStrategy, which runs batches remotely).

    model.fit(..., callbacks=[cmlcluster.keras_callback()]): step counts batches over all
    epochs, total is epochs x steps when Keras knows the steps.
    """
    import tensorflow as tf

    class ProgressCallback(tf.keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self._epoch = 0
            self._last = 0.0

        def _implements_train_batch_hooks(self) -> bool:
            # Keras refuses batch hooks under ParameterServerStrategy (its batch logs are remote
            # values there); report epochs only in that case instead of failing fit().
            strategy = getattr(self.model, "distribute_strategy", None)
            return "ParameterServer" not in type(strategy).__name__

        def _steps(self) -> int | None:
            steps = (self.params or {}).get("steps")
            return int(steps) if steps else None

        def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
            self._epoch = epoch

        def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
            now = time.monotonic()
            if now - self._last >= every_seconds:
                self._last = now
                self._report(batch + 1, logs)

        def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
            self._last = time.monotonic()
            self._report(self._steps() or 0, logs)

        def _report(self, batch: int, logs: Mapping[str, Any] | None) -> None:
            steps = self._steps()
            epochs = (self.params or {}).get("epochs")
            step = self._epoch * (steps or 0) + batch if steps else self._epoch + 1
            total = epochs * steps if steps and epochs else epochs
            numeric = {k: v for k, v in (logs or {}).items() if _is_number(v)}
            report(step, total, **numeric)

    return ProgressCallback()


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
