"""What happens to a session's pods, learnt from one watch of them (no polling loop).

PodWatch streams the API's events on a thread of its own: a watch that drops is resumed from the
last resourceVersion it delivered, and one whose history has been compacted away (410 Gone)
starts again from a fresh list. PodTracker takes each event on the session's loop and ends the
pod's handle with Kubernetes' own words when it cannot be scheduled, its image cannot be pulled
or its container cannot be created, when it is evicted, OOM-killed, or deleted by someone else;
it copies each pod's log to the worker's (capped) log file on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...logfile import CappedLog
from ..base import OUTPUT_DRAIN_SECONDS
from .names import CONTAINER_NAME
from .pods import (
    NO_EXIT_CODE,
    api_message,
    container_state,
    contract_code,
    fatal_waiting,
    pod_reason,
    termination_reason,
    unschedulable,
)

log = logging.getLogger(__name__)

WATCH_SECONDS = 10  # each watch request ends after this long and is resumed: stop() takes at most this


@dataclass
class PodHandle:
    """One worker's pod. Its flags only ever go from False to True (and `unschedulable` from a
    timer back to None once the pod is placed): `ended` once its end is known; `deleting` once this
    backend asked for its deletion; `deleted_by_other` when the API marked it for deletion first;
    `abandoned` when its start failed or was cancelled."""

    worker_id: str
    name: str
    log_path: str
    loop: asyncio.AbstractEventLoop  # the one that started it: what the watch says is handled there
    exited: asyncio.Future[int]
    reason: str | None = None  # why it ended, when its exit code does not say (exit_reason)
    deleting: bool = False  # by this backend: a stop, not someone else's kubectl delete
    deleted_by_other: bool = False  # the API marked it for deletion, and not on this backend's word
    ended: bool = False  # its end is known; exited resolves once its log is read
    ip: str | None = None
    log_thread: threading.Thread | None = None
    unschedulable: asyncio.TimerHandle | None = None  # fails it unless the scheduler places it meanwhile
    created_at: float | None = None  # when the API answered its create (monotonic)
    abandoned: bool = False  # its start failed or was cancelled: a pod created all the same is deleted


class PodWatch:
    """One session's watch of its pods (core: a CoreV1Api), stopped by that session's close(),
    never by the next attach. Each event goes to on_event(kind, pod) and, after each fresh list,
    the names listed to on_listed(names, listed_at), both on the watch's own thread."""

    def __init__(
        self,
        core: Any,
        namespace: str,
        selector: str,
        on_event: Callable[[str, Any], None],
        on_listed: Callable[[set[str], float], None],
    ):
        self._core = core
        self._namespace = namespace
        self._selector = selector
        self._on_event = on_event
        self._on_listed = on_listed
        self._stop = threading.Event()
        self._watch: Any = None  # the kubernetes.watch.Watch streaming now
        self._thread = threading.Thread(target=self._run, name="cmlcluster-kubernetes-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Tells the thread to end; join() waits for it (a watch request ends within WATCH_SECONDS)."""
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.stop()
            response = getattr(watch, "_resp", None)  # a blocked read ends when its socket does
            if response is not None:
                with contextlib.suppress(Exception):
                    response.shutdown()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        core, namespace, selector = self._core, self._namespace, self._selector
        version: str | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                if version is None:  # the first time, and after history was compacted away (410)
                    listed_at = time.monotonic()
                    pods = core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=15)
                    for pod in pods.items:
                        self._on_event("MODIFIED", pod)
                    self._on_listed({pod.metadata.name for pod in pods.items}, listed_at)
                    version = pods.metadata.resource_version
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    core.list_namespaced_pod,
                    namespace,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=WATCH_SECONDS,
                    allow_watch_bookmarks=True,
                    _request_timeout=WATCH_SECONDS + 20,
                ):
                    if self._stop.is_set():
                        return
                    if event["type"] != "BOOKMARK":  # a bookmark only moves the resourceVersion on
                        self._on_event(event["type"], event["object"])
                    failures = 0
                version = self._watch.resource_version or version  # the stream ended: resume where it was
            except ApiException as e:
                if e.status == 410:  # too old to resume: list again
                    version = None
                    continue
                failures += 1
                log.warning("cmlcluster: the watch of this session's pods failed (%s); resuming", api_message(e))
            except Exception as e:  # the connection dropped
                if self._stop.is_set():
                    return
                failures += 1
                if self._watch is not None and self._watch.resource_version:
                    version = self._watch.resource_version
                log.debug("cmlcluster: the watch of this session's pods broke (%s); resuming", e)
            self._stop.wait(min(5.0, 0.2 * 2**failures) if failures else 0)


class PodTracker:
    """Each of the session's pods through what the watch reports, on the loop that started it.

    handles: the backend's, by pod name (it adds and removes them); core: a CoreV1Api for the
    logs; wait_for_nodes: seconds an unschedulable pod may wait; delete(handle): deletes a pod
    that will not run, on a thread of its own.
    """

    def __init__(
        self,
        handles: dict[str, PodHandle],
        core: Any,
        namespace: str,
        wait_for_nodes: float,
        delete: Callable[[PodHandle], None],
    ):
        self.handles = handles
        self._core = core
        self._namespace = namespace
        self._wait_for_nodes = wait_for_nodes
        self._delete = delete

    # ---------------------------------------------------------------- from the watch's thread

    def report(self, kind: str, pod: Any) -> None:
        handle = self.handles.get(pod.metadata.name)
        if handle is not None and not handle.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                handle.loop.call_soon_threadsafe(self._on_pod, kind, pod)

    def report_missing(self, listed: set[str], listed_at: float) -> None:
        """Pods that a fresh list no longer has were deleted while the watch could not say so."""
        for handle in list(self.handles.values()):
            if handle.created_at is not None and handle.created_at < listed_at and handle.name not in listed:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                    handle.loop.call_soon_threadsafe(self._on_missing, handle)

    # ---------------------------------------------------------------- on the session's loop

    def _on_missing(self, handle: PodHandle) -> None:
        gone = f"its pod {handle.name} is gone (deleted while the watch of the session's pods was down)"
        self.end(handle, NO_EXIT_CODE, None if handle.deleted_by_other else gone, ran=False)

    def _on_pod(self, kind: str, pod: Any) -> None:
        """One event about one pod."""
        handle = self.handles.get(pod.metadata.name)
        if handle is None or handle.ended:
            return
        status = pod.status
        state = container_state(pod)
        # A deletion shows first as a deletionTimestamp, then the container stops, then the pod goes.
        if pod.metadata.deletion_timestamp is not None and not handle.deleting:
            handle.deleted_by_other = True
        if kind == "DELETED":
            terminated = state.terminated if state is not None else None
            if terminated is not None:
                self.end(handle, terminated.exit_code, termination_reason(terminated, pod))
            else:
                gone = None if handle.deleted_by_other else f"its pod {handle.name} was deleted"  # end says by whom
                self.end(handle, NO_EXIT_CODE, gone, ran=False)
            return
        if status is None:
            return
        if status.pod_ip and handle.ip is None:
            handle.ip = status.pod_ip
        if status.phase in ("Succeeded", "Failed"):
            terminated = state.terminated if state is not None else None
            if terminated is not None:
                self.end(handle, terminated.exit_code, termination_reason(terminated, pod))
            else:  # evicted before its container ran, say
                why = pod_reason(pod) or f"its pod {handle.name} {status.phase.lower()}"
                self.end(handle, NO_EXIT_CODE, why, ran=False)
            return
        if state is not None and state.running is not None:
            self.follow_log(handle)
        fatal = fatal_waiting(pod)
        if fatal is not None:
            self.give_up(handle, fatal)
            return
        placement = unschedulable(pod)
        if placement is not None and handle.unschedulable is None:
            reason = f"Unschedulable: {placement}"
            if self._wait_for_nodes:
                reason += f" (for {self._wait_for_nodes:g} s: wait_for_nodes)"
            handle.unschedulable = handle.loop.call_later(self._wait_for_nodes, self.give_up, handle, reason)
        elif placement is None and handle.unschedulable is not None and (pod.spec and pod.spec.node_name):
            handle.unschedulable.cancel()  # placed after all (a node was added): it starts
            handle.unschedulable = None

    def give_up(self, handle: PodHandle, reason: str) -> None:
        """A pod that will not run as it is: it fails with `reason`, and is deleted."""
        if handle.ended:
            return
        self.end(handle, NO_EXIT_CODE, reason, ran=False)
        handle.deleting = True
        self._delete(handle)

    def end(self, handle: PodHandle, code: int | None, reason: str | None, ran: bool = True) -> None:
        """The pod is done: its exit is reported once its output has been read (output() for messages)."""
        if handle.ended:
            return
        handle.ended = True
        if handle.unschedulable is not None:
            handle.unschedulable.cancel()
        if handle.deleted_by_other:
            reason = "; ".join(filter(None, [f"its pod {handle.name} was deleted by someone else", reason]))
        handle.reason = reason
        final = contract_code(code)

        def report(_: object = None) -> None:
            if not handle.exited.done():
                handle.exited.set_result(final)

        if ran:
            self.follow_log(handle)  # a container that ended before the watch saw it run: its whole log
        if handle.log_thread is None:
            report()
            return
        # The contract's wait(): the exit is reported once the pod's log has been read to its end.
        drained = asyncio.ensure_future(asyncio.to_thread(handle.log_thread.join, OUTPUT_DRAIN_SECONDS))
        drained.add_done_callback(report)

    # ---------------------------------------------------------------- logs

    def follow_log(self, handle: PodHandle) -> None:
        if handle.log_thread is None:
            handle.log_thread = threading.Thread(
                target=self._copy_log, args=(handle,), name=f"cmlcluster-log-{handle.worker_id}", daemon=True
            )
            handle.log_thread.start()

    def _copy_log(self, handle: PodHandle) -> None:
        """The container's output into the worker's log file, from its start to its end (own thread)."""
        with contextlib.suppress(Exception), CappedLog(handle.log_path) as out:
            response = self._core.read_namespaced_pod_log(
                handle.name,
                self._namespace,
                container=CONTAINER_NAME,
                follow=True,
                _preload_content=False,
            )
            try:
                for chunk in response.stream(4096):
                    out.write(chunk)
            finally:
                response.release_conn()
