"""Detaching this process, a TF2 ParameterServerStrategy coordinator, from a cluster it coordinated.

TensorFlow has no public disconnect. Every tf.function is an AtomicFunction whose
__del__ removes it from every task in the eager context's list of remote contexts
(EagerContext::MaybeRemoveFunctionRemotely, core/common_runtime/eager/context.cc),
and nothing ever takes a dead task off that list. Once a cluster's servers are
gone, each function freed logs "Failed to remove function remotely" once per task,
and, with ParameterServerStrategy's blocking enqueue, each removal blocks the
thread that frees it until the RPC fails: forever, for a peer that stops
answering. The next strategy's set_server_def also tries to close the old
contexts.

The way out (found by reading that code and tested on 2.15): while the servers
still answer, shrink the eager context's cluster to this process's own job with
update_server_def. That sends CloseContext to the removed tasks and erases them
from the list, so later removals have no remote target; update_server_def, unlike
set_server_def, keeps the in-process gRPC server on the coordinator's port, so
the next cluster connects as usual.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


def _coordinator_clusters() -> list[Any]:
    """The ClusterCoordinator clusters running in this process, found through their threads.

    A coordinator's cluster runs a WorkerPreemptionHandler thread and one closure loop
    per worker, each the bound method of an object holding `_cluster`. The strategy
    that owns them is the user's; threads are the one handle on them we have.
    """
    clusters = {}
    for thread in threading.enumerate():
        owner = getattr(getattr(thread, "_target", None), "__self__", None)  # CPython's Thread._target
        cluster = getattr(owner, "_cluster", None)
        if cluster is not None and hasattr(cluster, "closure_queue") and hasattr(cluster, "stop"):
            clusters[id(cluster)] = cluster
    return list(clusters.values())


def _recovering(cluster: Any) -> bool:
    """Whether the cluster's preemption handler waits for a lost worker (in update_server_def, forever).

    It holds its update lock meanwhile, which stopping the cluster needs: such a cluster
    (one whose job failed) is left alone.
    """
    lock = getattr(getattr(cluster, "failure_handler", None), "_cluster_update_lock", None)
    return lock is not None and lock.locked()


def _connected_to(cluster_spec: Mapping[str, Sequence[str]]) -> Any:
    """This process's eager server_def if it coordinates exactly this cluster's remote tasks, else None."""
    if "tensorflow" not in sys.modules:
        return None  # never imported here: this process coordinated nothing
    from tensorflow.python.eager import context

    server_def = context.context().get_server_def()
    if server_def is None:
        return None
    me = server_def.job_name
    remote = {
        (job.name, i, address) for job in server_def.cluster.job if job.name != me for i, address in job.tasks.items()
    }
    wanted = {
        (job, i, address) for job, addresses in cluster_spec.items() if job != me for i, address in enumerate(addresses)
    }
    return server_def if remote and remote == wanted else None


def fail(cluster_spec: Mapping[str, Sequence[str]], error: BaseException) -> bool:
    """Make the coordinator's waits (model.fit, ClusterCoordinator.join/schedule) raise `error` now.

    TensorFlow takes a lost worker for a preempted one and waits for it to come back,
    forever when nothing restarts it; a lost parameter server surfaces only when a step
    touches it. When the job has failed, the coordinator should fail too.
    """
    if _connected_to(cluster_spec) is None:
        return False
    for cluster in _coordinator_clusters():
        queue = cluster.closure_queue
        with queue._queue_lock:  # what mark_failed does, without its bookkeeping of one failed closure
            if queue._error is None:
                queue._error = error
            queue._stop_waiting_condition.notify_all()
    return True


def detach(cluster_spec: Mapping[str, Sequence[str]]) -> bool:
    """Forget this cluster's remote tasks; call it before its servers stop. True if there was something to do.

    Nothing happens unless this process's eager context is connected to exactly this
    cluster's remote tasks: stopping an old cluster never detaches a newer one.
    """
    server_def = _connected_to(cluster_spec)
    if server_def is None:
        return False
    from tensorflow.python.eager import context

    # The coordinators' threads first: a "recovering" preemption handler would call
    # update_server_def with the old cluster again, and closure loops would run closures.
    local = type(server_def)()
    local.CopyFrom(server_def)
    own = [job for job in local.cluster.job if job.name == server_def.job_name]
    del local.cluster.job[:]
    local.cluster.job.extend(own)
    local.ClearField("cluster_device_filters")
    with _quiet_tensorflow_logger():  # it narrates each stop at INFO, which a notebook shows
        for cluster in _coordinator_clusters():
            if not _recovering(cluster):
                cluster.stop()
                # ClusterCoordinator.__del__ stops it again, possibly at interpreter exit, when
                # a kernel's streams are closed and its INFO lines become "Logging error"s.
                cluster.stop = lambda: None
        context.context().update_server_def(local)
    return True


@contextlib.contextmanager
def _quiet_tensorflow_logger() -> Iterator[None]:
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
