"""The widget's Stop while the notebook, as a cluster's coordinator, trains on it (model.fit).

Training as ParameterServerStrategy's coordinator runs in TensorFlow's code, not in a cmlcluster call,
so nothing marked the cell as held (cmlcluster.blocking) and a click on Stop only stopped the
workers: TensorFlow took them for preempted ones and waited for them forever, or failed on the lost
parameter server with a traceback under a screen of its threads' log lines.

The mark is as narrow as TensorFlow allows: while the main thread is inside the cluster's strategy's
scope (Keras's fit, evaluate and predict run whole inside `model.distribute_strategy.scope()`, and so
does building a model) or inside a ClusterCoordinator call on it (schedule, join, fetch: a custom
training loop). A strategy is the cluster's by its cluster resolver, the one TFCluster.resolver made;
calls on any other strategy pass straight through. A click there interrupts the call as the kernel's
Interrupt (■) would, the widget stops the workers, and the cluster stands down as a failed one does
(coordinator.fail: TensorFlow's threads wait without touching the eager context, and a later call on
the strategy raises) and is stopped, so that the next cluster in the same kernel trains.

The strategy's `scope` and ClusterCoordinator's methods are public, wrapped once per process; the
resolver a strategy was made with is read where TensorFlow keeps it (internals.strategy_resolver).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .. import blocking
from ..errors import CmlClusterError
from . import coordinator, internals

# What the main thread calls on a ClusterCoordinator; join and fetch wait for the workers.
COORDINATOR_CALLS = ("schedule", "join", "done", "fetch", "create_per_worker_dataset")
STOPPED = "this TensorFlow cluster was stopped from the widget; start a new one"

_clusters: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # resolver -> its TFCluster
_stood_down: weakref.WeakSet[Any] = weakref.WeakSet()  # TensorFlow's coordinator Clusters stopped from the widget
_stopped_once = False  # a cluster of this process was stopped from the widget: its executors may still be collected
# The gRPC errors of work on workers that are gone (tf.errors' class names).
LOST_WORKER_ERRORS = frozenset({"UnavailableError", "CancelledError", "AbortedError"})


def stoppable(resolver: Any, cluster: Any) -> Any:
    """`resolver`, made by `cluster` (a TFCluster): the widget's Stop ends a call on a strategy built on it."""
    _wrap_once()
    _clusters[resolver] = cluster
    return resolver


def _cluster_of(strategy: Any) -> Any:
    resolver = internals.strategy_resolver(strategy)
    return None if resolver is None else _clusters.get(resolver)


@contextlib.contextmanager
def _held(cluster: Any) -> Iterator[None]:
    """The main thread is in a call on `cluster`'s strategy: Stop ends the call, then the cluster."""
    try:
        with blocking.blocking(cluster.session):
            try:
                yield
            except BaseException:
                if blocking.stopping(cluster.session):  # at once, while the widget stops the workers
                    _stand_down(cluster)
                raise
    except blocking.StoppedFromWidget:
        _stand_down(cluster)
        cluster.stop()  # not detached: no server is left to answer (coordinator.detach)
        raise


def _stand_down(cluster: Any) -> None:
    """The cluster's workers are ending: TensorFlow's threads would wait for them for good (quietly:
    coordinator.fail), and a later call on the strategy raises instead of waiting too."""
    global _stopped_once
    _stopped_once = True
    _stood_down.update(coordinator.fail(cluster.cluster_spec, CmlClusterError(STOPPED)))


@contextlib.contextmanager
def _held_scope(cluster: Any, scope: Any) -> Iterator[Any]:
    with _held(cluster), scope as strategy:
        yield strategy


def _wrap_once() -> None:
    import tensorflow as tf

    strategy_class = tf.distribute.experimental.ParameterServerStrategy
    if getattr(strategy_class.scope, "cmlcluster_stoppable", False):
        return
    scope = strategy_class.scope

    @functools.wraps(scope)
    def stoppable_scope(self: Any) -> Any:
        cluster = _cluster_of(self)
        return scope(self) if cluster is None else _held_scope(cluster, scope(self))

    coordinator_class = tf.distribute.experimental.coordinator.ClusterCoordinator
    for name in COORDINATOR_CALLS:
        setattr(coordinator_class, name, _holding(getattr(coordinator_class, name)))
    stoppable_scope.cmlcluster_stoppable = True  # type: ignore[attr-defined]
    strategy_class.scope = stoppable_scope
    logging.getLogger("tensorflow").addFilter(_quiet_once_stopped)
    sys.unraisablehook = _without_stopped_executors(sys.unraisablehook)


def _quiet_once_stopped(record: logging.LogRecord) -> bool:
    """Drop what a coordinator's threads log about workers that Stop is ending or ended: each lost
    worker's gRPC error and TensorFlow's recovery, a screen of lines above the cell's StoppedFromWidget.
    (The widget marks the call stopping at once, before the workers it stops have ended.)"""
    cluster = internals.cluster_of(internals.thread_owner(threading.current_thread()))
    if cluster is None:
        return True  # not a coordinator's thread
    return cluster not in _stood_down and not any(blocking.stopping(c.session) for c in list(_clusters.values()))


def _without_stopped_executors(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`hook` (sys.unraisablehook) without what a coordinator thread's executor raises when it is collected
    after Stop ended the workers it had work on: its __del__ waits for that work, gets the workers' gRPC
    error (UnavailableError, "Connection reset by peer") and Python prints it as "Exception ignored in:
    Executor.__del__" under the cell, long after StoppedFromWidget. Anything else reaches `hook`."""

    def quieter(unraisable: Any) -> Any:
        stopped_executor = (
            _stopped_once
            and getattr(unraisable.object, "__qualname__", "") == "Executor.__del__"
            and type(unraisable.exc_value).__name__ in LOST_WORKER_ERRORS
        )
        return None if stopped_executor else hook(unraisable)

    return quieter


def _holding(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        cluster = _cluster_of(self.strategy)
        if cluster is None:
            return method(self, *args, **kwargs)
        with _held(cluster):
            return method(self, *args, **kwargs)

    return call
