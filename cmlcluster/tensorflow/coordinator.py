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

A failed job is different: TensorFlow takes its lost worker for a preempted one, and
the coordinator's preemption handler thread calls update_server_def with the old
cluster, which blocks until the lost task answers again: forever. Meanwhile it
changes the process-wide eager context while the next cluster's strategy does
(set_server_def), a segfault (one run in two of this repository's
kill-9-while-coordinating tests; TensorFlow's own TODO in WorkerPreemptionHandler.stop
says the thread "touches eager context which is a process-wide singleton").
guard_recovery() makes that thread wait in Python instead, until every remote
task accepts connections again (a transient loss: TensorFlow recovers as it
would) or cmlcluster has failed the job (a task's process ended: cmlcluster never
restarts one), in which case the handler waits for good without touching the
context.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from . import internals


def _coordinator_clusters() -> list[Any]:
    """The ClusterCoordinator clusters running in this process, found through their threads.

    A coordinator's cluster runs a WorkerPreemptionHandler thread and one closure loop
    per worker, each the bound method of an object holding the cluster. The strategy
    that owns them is the user's; threads are the one handle on them we have.
    """
    clusters = {}
    for thread in threading.enumerate():
        cluster = internals.cluster_of(internals.thread_owner(thread))
        if cluster is not None:
            clusters[id(cluster)] = cluster
    return list(clusters.values())


def _handler_threads(cluster: Any) -> list[threading.Thread]:
    """The threads that run the cluster's preemption handler (TensorFlow starts one)."""
    return [
        thread
        for thread in threading.enumerate()
        if thread.name == internals.PREEMPTION_HANDLER_THREAD
        and internals.cluster_of(internals.thread_owner(thread)) is cluster
    ]


def _recovering(cluster: Any) -> bool:
    """Whether the cluster's preemption handler waits for a lost worker (in update_server_def, forever).

    It holds its update lock meanwhile, which stopping the cluster needs: such a cluster
    (one whose job failed) is left alone.
    """
    lock = internals.update_lock(cluster)
    return lock is not None and lock.locked()


Tasks = frozenset[tuple[str, int, str]]  # a cluster's remote tasks: (job, index, host:port)

_failed: set[Tasks] = set()  # the clusters whose job failed (fail()), by their remote tasks
HANDLER_STOP_SECONDS = 5.0  # how long detach waits for a stopped cluster's handler thread to end
RECOVERY_POLL_SECONDS = 0.2  # how often a waiting preemption handler looks again
# How long every lost task must go on accepting connections to count as back. A task killed with
# SIGKILL still accepts while the kernel tears its process down (its memory is unmapped before its
# files close: long for TensorFlow's gigabytes on a loaded machine), and the job's failure (fail())
# comes a moment after the backend sees the exit: a handler let through on one such connect then
# waited in update_server_def for good (CI, two test processes on two cores: 5 tests failed).
RECOVERY_SETTLE_SECONDS = 5.0


def _remote_tasks(server_def: Any) -> Tasks:
    me = server_def.job_name
    return frozenset(
        (job.name, i, address) for job in server_def.cluster.job if job.name != me for i, address in job.tasks.items()
    )


def _connected_to(cluster_spec: Mapping[str, Sequence[str]]) -> Any:
    """This process's eager server_def if it coordinates exactly this cluster's remote tasks, else None."""
    if "tensorflow" not in sys.modules:
        return None  # never imported here: this process coordinated nothing
    server_def = internals.eager_context().get_server_def()
    if server_def is None:
        return None
    remote = _remote_tasks(server_def)
    return server_def if remote and remote == _spec_tasks(cluster_spec, server_def.job_name) else None


def _spec_tasks(cluster_spec: Mapping[str, Sequence[str]], me: str) -> Tasks:
    return frozenset(
        (job, i, address) for job, addresses in cluster_spec.items() if job != me for i, address in enumerate(addresses)
    )


def guard_recovery(cluster_spec: Mapping[str, Sequence[str]], me: str) -> None:
    """Make TensorFlow's preemption handlers wait for lost tasks here, not in update_server_def (see
    above), before this process, task `me`, coordinates the cluster. The guard is installed once:
    the eager context is the process's.
    """
    internals.probe()
    _failed.discard(_spec_tasks(cluster_spec, me))  # an earlier cluster's, should its ports come round again

    ctx = internals.eager_context()
    if getattr(ctx.update_server_def, "cmlcluster_guard", False):
        return
    update_server_def = ctx.update_server_def

    def guarded(server_def: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == internals.PREEMPTION_HANDLER_THREAD:
            _wait_for_lost_tasks(ctx, server_def)
        return update_server_def(server_def, *args, **kwargs)

    guarded.cmlcluster_guard = True  # type: ignore[attr-defined]
    ctx.update_server_def = guarded


def _wait_for_lost_tasks(ctx: Any, server_def: Any) -> None:
    """Return once every task has accepted connections for RECOVERY_SETTLE_SECONDS; never, once fail()
    was called for them, or once this process coordinates another cluster (whose tasks may even reuse
    these addresses)."""
    tasks = _remote_tasks(server_def)
    accepting_since: float | None = None
    while tasks not in _failed and ctx.get_server_def() is server_def:
        if not all(_accepts(address) for _, _, address in tasks):
            accepting_since = None
        elif accepting_since is None:
            accepting_since = time.monotonic()
        elif time.monotonic() - accepting_since >= RECOVERY_SETTLE_SECONDS:
            return
        time.sleep(RECOVERY_POLL_SECONDS)
    _park_for_good()


def _park_for_good() -> None:
    """Wait forever, as TensorFlow would have in update_server_def, but without touching the eager
    context. (Raising instead hands the error to the closure threads, and TensorFlow's mark_failed
    then dies on "There is no inflight closures to mark_failed": a thread traceback under the cell.)
    fail() already made the coordinator's waits raise the job's error; a stopped cluster has none."""
    threading.Event().wait()


def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RECOVERY_POLL_SECONDS):
            return True
    except OSError:
        return False


def fail(cluster_spec: Mapping[str, Sequence[str]], error: BaseException) -> list[Any]:
    """Make the coordinator's waits (model.fit, ClusterCoordinator.join/schedule) raise `error` now.

    TensorFlow takes a lost worker for a preempted one and waits for it to come back,
    forever when nothing restarts it; a lost parameter server surfaces only when a step
    touches it. When the job has failed, the coordinator should fail too. Returns the
    coordinators' clusters failed (none unless this process coordinates this cluster).
    """
    server_def = _connected_to(cluster_spec)
    if server_def is None:
        return []
    _failed.add(_remote_tasks(server_def))  # a preemption handler waiting in guard_recovery gives up
    clusters = _coordinator_clusters()
    for cluster in clusters:
        internals.fail_closure_queue(cluster, error)
        # Its preemption handler may wait for good, holding the lock that stopping the cluster takes:
        # ClusterCoordinator.__del__ (the user's strategy collected) would then block forever.
        cluster.stop = lambda: None
    return clusters


def detach(cluster_spec: Mapping[str, Sequence[str]]) -> bool:
    """Forget this cluster's remote tasks; call it before its servers stop. True if there was something to do.

    Nothing happens unless this process's eager context is connected to exactly this
    cluster's remote tasks: stopping an old cluster never detaches a newer one.
    """
    server_def = _connected_to(cluster_spec)
    if server_def is None or _remote_tasks(server_def) in _failed:  # failed: its servers are gone already
        return False
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
            if not _recovering(cluster):  # else its handler holds the lock stop() takes (it parks for good)
                cluster.stop()
                for thread in _handler_threads(cluster):
                    # stop() only wakes the handler, which narrates its own end on its thread: the INFO
                    # line would otherwise reach the notebook after the logger is loud again.
                    thread.join(HANDLER_STOP_SECONDS)
            # ClusterCoordinator.__del__ stops it again, possibly at interpreter exit, when a kernel's
            # streams are closed and its INFO lines become "Logging error"s, or for ever on that lock.
            cluster.stop = lambda: None
        internals.eager_context().update_server_def(local)
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
