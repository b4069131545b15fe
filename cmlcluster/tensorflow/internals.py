"""Every private name of TensorFlow (and of CPython's threading) that cmlcluster relies on, in one place.

TensorFlow has no public way to disconnect a coordinator from a cluster, to fail its waits
when a job failed, to find the coordinators running in a process (coordinator.py says
why each is needed), or to tell which cluster a ParameterServerStrategy trains on (its
public cluster_resolver is None: stopping.py). These are the names it takes instead. probe() checks each of them on
the TensorFlow this process imported, before this process coordinates anything: on a
TensorFlow that renamed one, the user gets an error naming the version and the name, not
a guard that silently does nothing and the hang it prevents.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from .. import probes
from ..errors import CmlClusterError

# TensorFlow's name for the thread that recovers a coordinator's lost workers (cluster_coordinator.py).
PREEMPTION_HANDLER_THREAD = "WorkerPreemptionHandler"

_probed: str | None = None  # the TensorFlow version probe() passed on


def eager_context() -> Any:
    """The process's eager context (get_server_def, update_server_def)."""
    from tensorflow.python.eager import context

    return context.context()


def thread_owner(thread: threading.Thread) -> Any:
    """The object whose bound method a thread runs (CPython keeps the target in Thread._target)."""
    return getattr(getattr(thread, "_target", None), "__self__", None)


def cluster_of(owner: Any) -> Any:
    """The coordinator Cluster a closure loop (Worker) or a preemption handler belongs to, or None."""
    cluster = getattr(owner, "_cluster", None)
    return cluster if cluster is not None and hasattr(cluster, "closure_queue") and hasattr(cluster, "stop") else None


def strategy_resolver(strategy: Any) -> Any:
    """The cluster resolver a ParameterServerStrategy was made with (its public `cluster_resolver`
    reads the extended strategy's, which this strategy never sets: None), or None."""
    return getattr(strategy, "_cluster_resolver", None)


def update_lock(cluster: Any) -> Any:
    """The lock a cluster's preemption handler holds while it waits for a lost worker, or None."""
    return getattr(getattr(cluster, "failure_handler", None), "_cluster_update_lock", None)


def fail_closure_queue(cluster: Any, error: BaseException) -> None:
    """Make every wait on the cluster's closures raise `error`: what the queue's mark_failed does,
    without its bookkeeping of the one closure that failed."""
    queue = cluster.closure_queue
    with queue._queue_lock:
        if queue._error is None:
            queue._error = error
        queue._stop_waiting_condition.notify_all()


def probe() -> None:
    """Raise CmlClusterError, naming TensorFlow's version and each name it lacks, unless every
    private name above is where cmlcluster reads it. Checked once per process."""
    global _probed
    import tensorflow as tf

    if _probed == tf.__version__:
        return
    missing = probes.missing(_checks())
    if missing:
        raise CmlClusterError(
            f"TensorFlow {tf.__version__} lacks what cmlcluster's coordinator support reads of it: "
            f"{'; '.join(missing)}. This process cannot coordinate parameter-server training safely with "
            "this version; use TensorFlow 2.15 to 2.21 (tested), or run_cluster() / run_script(), which "
            "need none of it."
        )
    _probed = tf.__version__


def _assigns(cls: Any, *attributes: str) -> bool:
    """Whether cls.__init__ assigns each of self.<attribute> (instance attributes exist only once built)."""
    source = inspect.getsource(cls.__init__)
    return all(f"self.{attribute} =" in source for attribute in attributes)


def _tf() -> Any:
    import tensorflow as tf

    return tf


def _checks() -> list[probes.Check]:
    def module() -> Any:
        from tensorflow.python.distribute.coordinator import cluster_coordinator

        return cluster_coordinator

    def handlers() -> list[Any]:
        m = module()
        return [getattr(m, name) for name in ("WorkerPreemptionHandler", "CoordinationServicePreemptionHandler")]

    return [
        ("threading.Thread._target", lambda: hasattr(threading.Thread(target=print), "_target")),
        (
            "eager context get_server_def/update_server_def",
            lambda: callable(eager_context().get_server_def) and callable(eager_context().update_server_def),
        ),
        (
            "cluster_coordinator.Cluster's closure_queue, failure_handler and stop",
            lambda: _assigns(module().Cluster, "closure_queue", "failure_handler") and callable(module().Cluster.stop),
        ),
        ("cluster_coordinator.Worker._cluster", lambda: _assigns(module().Worker, "_cluster")),
        (
            "ParameterServerStrategy's _cluster_resolver",
            lambda: _assigns(_tf().distribute.experimental.ParameterServerStrategy, "_cluster_resolver"),
        ),
        (
            "the preemption handlers' _cluster and _cluster_update_lock",
            lambda: all(_assigns(h, "_cluster", "_cluster_update_lock") for h in handlers()),
        ),
        (
            f"the preemption handler thread's name {PREEMPTION_HANDLER_THREAD!r}",
            lambda: all(f'name="{PREEMPTION_HANDLER_THREAD}"' in inspect.getsource(h) for h in handlers()),
        ),
        (
            "_CoordinatedClosureQueue's _queue_lock, _error and _stop_waiting_condition",
            lambda: all(
                hasattr(module()._CoordinatedClosureQueue(), name)
                for name in ("_queue_lock", "_error", "_stop_waiting_condition")
            ),
        ),
    ]
