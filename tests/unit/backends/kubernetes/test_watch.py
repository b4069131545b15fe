"""What the Kubernetes backend makes of its watch's events (backends/kubernetes/watch.py PodTracker),
on the recorded pods of test_kubernetes_pods, without a cluster: each event goes in as the watch's
thread hands it on, and a worker's handle must end with the contract's exit code and Kubernetes'
own words, its log copied, and a pod that will not run deleted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cmlcluster.backends.kubernetes.watch import PodHandle, PodTracker
from unit.backends.kubernetes.test_pods import as_watched, raw

LOG = [b"epoch 1/3\n", b"Killed\n"]


class FakeLog:
    def __init__(self) -> None:
        self.released = False

    def stream(self, amount: int):
        yield from LOG

    def release_conn(self) -> None:
        self.released = True


class FakeCore:
    """The one call PodTracker makes: a pod's log, followed."""

    def __init__(self) -> None:
        self.logs: list[tuple[str, str, str, bool]] = []

    def read_namespaced_pod_log(self, name, namespace, *, container, follow, _preload_content):
        self.logs.append((name, namespace, container, follow))
        return FakeLog()


class Tracked:
    """One worker's handle, for the pod named in its first recorded event, and what the tracker did."""

    def __init__(self, tmp_path, name: str, wait_for_nodes: float = 0.0):
        self.core = FakeCore()
        self.deleted: list[PodHandle] = []
        loop = asyncio.get_running_loop()
        self.handle = PodHandle(
            worker_id="a1b2c3-0",
            name=name,
            log_path=str(tmp_path / "worker.log"),
            loop=loop,
            exited=loop.create_future(),
            created_at=time.monotonic(),
        )
        self.tracker = PodTracker({name: self.handle}, self.core, "ml-team", wait_for_nodes, self.deleted.append)

    async def event(self, pod: Any, kind: str = "MODIFIED") -> None:
        await asyncio.to_thread(self.tracker.report, kind, pod)  # from the watch's thread
        await asyncio.sleep(0)  # the loop runs what was handed to it

    async def exit(self) -> int:
        return await asyncio.wait_for(asyncio.shield(self.handle.exited), 10)


def run(test):
    asyncio.run(asyncio.wait_for(test(), 30))


def test_an_oom_killed_pod_ends_with_sigkill_its_reason_and_its_whole_log(tmp_path):
    async def test():
        oom = as_watched(raw("oom_killed"))
        t = Tracked(tmp_path, oom.metadata.name)
        await t.event(oom)
        assert await t.exit() == -9
        assert t.handle.reason == "OOMKilled: it used more than its memory limit of 1536Mi"
        assert t.core.logs == [(oom.metadata.name, "ml-team", "worker", True)]
        assert (tmp_path / "worker.log").read_bytes() == b"".join(LOG)
        assert t.deleted == [] and not t.handle.deleting  # ended on its own: wait() deletes it

    run(test)


def test_an_image_that_cannot_be_pulled_fails_the_worker_and_deletes_its_pod(tmp_path):
    async def test():
        backoff = as_watched(raw("image_pull_backoff"))
        t = Tracked(tmp_path, backoff.metadata.name)
        await t.event(backoff)
        assert await t.exit() == 255
        assert t.handle.reason.startswith("ImagePullBackOff: Back-off pulling image")
        assert t.deleted == [t.handle] and t.handle.deleting
        assert t.core.logs == []  # it never ran: no log to read

    run(test)


def test_an_unschedulable_pod_fails_at_once_without_wait_for_nodes(tmp_path):
    async def test():
        pending = as_watched(raw("unschedulable"))
        t = Tracked(tmp_path, pending.metadata.name)
        await t.event(pending)
        assert await t.exit() == 255
        assert t.handle.reason.startswith("Unschedulable: 0/3 nodes are available")
        assert "wait_for_nodes" not in t.handle.reason
        assert t.deleted == [t.handle]

    run(test)


def test_an_unschedulable_pod_placed_within_wait_for_nodes_runs(tmp_path):
    async def test():
        pending = raw("unschedulable")
        t = Tracked(tmp_path, pending["metadata"]["name"], wait_for_nodes=60)
        await t.event(as_watched(pending))
        timer = t.handle.unschedulable
        assert timer is not None and not t.handle.ended
        placed = raw("running")  # a node was added: the same pod, scheduled and running
        placed["metadata"]["name"] = t.handle.name
        await t.event(as_watched(placed))
        assert timer.cancelled() and t.handle.unschedulable is None
        assert not t.handle.ended and not t.handle.exited.done()
        assert t.handle.ip == "10.244.2.31"
        assert t.deleted == []
        t.handle.log_thread.join(10)  # it ran: its log is followed
        assert (tmp_path / "worker.log").read_bytes() == b"".join(LOG)

    run(test)


def test_a_pod_deleted_by_someone_else_says_so(tmp_path):
    async def test():
        deleted = as_watched(raw("deleted_by_signal"))
        t = Tracked(tmp_path, deleted.metadata.name)
        await t.event(deleted)
        assert await t.exit() == -15
        assert t.handle.deleted_by_other
        assert t.handle.reason == f"its pod {t.handle.name} was deleted by someone else"

    run(test)


def test_a_pod_this_backend_deleted_says_nothing_more_than_its_exit(tmp_path):
    async def test():
        deleted = as_watched(raw("deleted_by_signal"), kind="DELETED")
        t = Tracked(tmp_path, deleted.metadata.name)
        t.handle.deleting = True  # stop() asked for it
        await t.event(deleted, kind="DELETED")
        assert await t.exit() == -15
        assert not t.handle.deleted_by_other and t.handle.reason is None

    run(test)


def test_an_evicted_pod_ends_with_the_kubelets_words(tmp_path):
    async def test():
        evicted = as_watched(raw("evicted"))
        t = Tracked(tmp_path, evicted.metadata.name)
        await t.event(evicted)
        assert await t.exit() == -9
        assert t.handle.reason.startswith("Evicted: The node was low on resource: ephemeral-storage.")

    run(test)


def test_a_pod_missing_from_a_fresh_list_is_gone(tmp_path):
    async def test():
        t = Tracked(tmp_path, "cmlcluster-a1b2c3-0")
        listed_before = t.handle.created_at - 1  # a list from before its create: it may not be in it yet
        await asyncio.to_thread(t.tracker.report_missing, set(), listed_before)
        await asyncio.sleep(0.05)
        assert not t.handle.ended
        await asyncio.to_thread(t.tracker.report_missing, {"cmlcluster-a1b2c3-9"}, time.monotonic())
        assert await t.exit() == 255
        assert (
            t.handle.reason
            == f"its pod {t.handle.name} is gone (deleted while the watch of the session's pods was down)"
        )

    run(test)


def test_events_after_the_end_change_nothing(tmp_path):
    async def test():
        oom = as_watched(raw("oom_killed"))
        t = Tracked(tmp_path, oom.metadata.name)
        await t.event(oom)
        assert await t.exit() == -9
        await t.event(as_watched(raw("oom_killed"), kind="DELETED"), kind="DELETED")
        await t.event(as_watched(raw("evicted")))  # another pod's name: not this handle's
        assert t.handle.reason.startswith("OOMKilled") and t.handle.exited.result() == -9

    run(test)
