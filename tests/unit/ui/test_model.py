"""The views' model (cmlcluster.ui.model): which call an event belongs to, and the words every view uses."""

from __future__ import annotations

from cmlcluster.events import (
    CallStarted,
    JobChanged,
    LaunchFailed,
    Member,
    OutputLine,
    Progress,
    ResourceUse,
    RunEnded,
    SessionClosed,
    WorkerStatus,
)
from cmlcluster.ui.model import Router, is_noise, order_key, reason
from cmlcluster.workers import Status, WorkerSnapshot


def status(worker_id: str, state: str, **more) -> WorkerStatus:
    return WorkerStatus(WorkerSnapshot(id=worker_id, status=Status(state), **more))


def test_each_call_shows_its_own_workers_and_the_output_of_its_run():
    router = Router()
    first = router.open_call("c0", "launch_workers")
    router.apply(CallStarted("c0", "launch_workers"))
    router.apply(status("a", "scheduling"))
    router.apply(status("b", "scheduling"))
    second = router.open_call("c1", "run_torch train.py")
    router.apply(CallStarted("c1", "run_torch train.py"))
    router.apply(status("c", "scheduling"))
    router.apply(OutputLine("a", "stdout", "a's line, printed after the second call began"))
    router.apply(OutputLine("rank 0", "stdout", "the run's rank"))  # no worker: the current call's
    router.apply(Progress("rank 0", 1, 10, {"loss": 1.0}))
    router.apply(LaunchFailed("one of the run's workers could not start"))
    assert list(first.workers) == ["a", "b"] and list(second.workers) == ["c"]
    assert first.sources() == ["a"] and second.sources() == ["rank 0"]
    assert list(second.progress) == ["rank 0"] and not first.progress
    assert first.notes == [] and second.notes == ["one of the run's workers could not start"]
    assert set(router.whole.workers) == {"a", "b", "c"}  # the whole session's view has everything
    assert router.whole.sources() == ["rank 0", "a"]  # rank 0 first
    router.apply(SessionClosed("s"))
    assert first.closed and second.closed and router.whole.closed


def test_await_workers_in_a_later_cell_gets_a_view_of_the_workers_it_waits_for_and_in_their_cell_joins():
    router = Router()
    launched = router.open_call("c0", "launch_workers")
    router.apply(CallStarted("c0", "launch_workers"))
    router.apply(status("a", "running", running_at=1.0))
    router.join_call("c1", "c0")  # await_workers in the cell that launched them
    router.apply(CallStarted("c1", "await_workers", ("a",)))
    assert router.calls() == [launched]
    awaited = router.open_call("c2", "await_workers")  # in a later cell
    router.apply(CallStarted("c2", "await_workers", ("a",)))
    assert awaited.workers["a"]["status"] == "running" and "a" in awaited.running_since  # seeded
    router.apply(status("a", "succeeded"))
    assert awaited.workers["a"]["status"] == "succeeded" and launched.workers["a"]["status"] == "succeeded"


def test_short_labels_in_table_order_and_a_job_names_its_members():
    router = Router()
    router.apply(CallStarted("c0", "start_cluster"))
    for worker_id in ("s-0", "s-1", "s-2", "s-3"):
        router.apply(status(worker_id, "running"))
    members = (Member("s-0", "ps", 0), Member("s-2", "worker", 1), Member("s-1", "worker", 0))
    router.apply(JobChanged("TensorFlow cluster", "started", members))
    model = router.calls()[0]
    assert [row["label"] for row in model.rows()] == ["worker 0", "worker 1", "w3", "ps 0"]
    assert sorted(["rank 10", "rank 2", "w10", "w9", "horovodrun"], key=order_key) == [
        "rank 2",
        "rank 10",
        "w9",
        "w10",
        "horovodrun",
    ]


def test_the_title_counts_each_status_and_a_node_stopped_by_a_run_that_went_well_shows_as_succeeded():
    router = Router()
    router.apply(CallStarted("c0", "run_torch train.py"))
    for worker_id in ("n0", "n1", "bad"):
        router.apply(status(worker_id, "running"))
    router.apply(JobChanged("PyTorch job", "started", (Member("n0", "node", 0), Member("n1", "node", 1))))
    model = router.calls()[0]
    assert model.summary() == "3 running"
    router.apply(status("bad", "failed", message="worker bad exited with code 3; last output:\nboom\nValueError: x"))
    router.apply(JobChanged("PyTorch job", "finished", (Member("n0", "node", 0), Member("n1", "node", 1))))
    router.apply(status("n0", "stopped", exit_code=-15))
    assert model.summary() == "1 running · 1 failed · 1 stopped"  # not yet known to have gone well
    router.apply(status("n1", "stopped", exit_code=-15))
    router.apply(RunEnded("torchrun", True, "torchrun succeeded: 4 processes on 2 nodes"))
    assert model.summary() == "2 succeeded · 1 failed"
    node = {r["label"]: r for r in model.rows()}["node 0"]
    assert node["status"] == "succeeded" and node["exit_code"] is None  # not "stopped, -15"
    router.apply(SessionClosed("s"))
    assert model.summary() == "closed (2 succeeded · 1 failed)"


def test_a_run_that_failed_leaves_its_stopped_nodes_stopped():
    router = Router()
    router.apply(status("n0", "running"))
    router.apply(JobChanged("PyTorch job", "started", (Member("n0", "node", 0),)))
    router.apply(status("n0", "stopped"))
    router.apply(RunEnded("torchrun", False, "the PyTorch job failed"))
    router.apply(RunEnded("torchrun", True, "a later run went well"))  # not the stopped node's run
    assert router.whole.status("n0") == "stopped"


def test_reason_says_what_happened_and_the_last_line_printed():
    failed = {"message": "worker 0a1b exited with code 3; last output:\nTraceback ...\nValueError: bad lr"}
    assert reason(failed) == "worker 0a1b exited with code 3: ValueError: bad lr"
    assert reason({"message": "timed out after 60 s"}) == "timed out after 60 s"
    assert reason({}) == ""


def test_framework_info_noise_is_folded_away_unless_asked_for():
    noise = [
        "2026-11-28 11:00:00.123456: I tensorflow/core/platform/cpu_feature_guard.cc:182] This TensorFlow binary",
        "I1128 11:00:00.123456  4242 server_lib.cc:12] Started server",
        "INFO:tensorflow:Enabled multi-worker collective ops",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
        "appropriate compiler flags.",
    ]
    kept = [
        "2026-11-28 11:00:00.123456: W tensorflow/core/ops.cc:1] a warning stays",
        "Epoch 1/3",
        "INFO is what I print myself",
    ]
    assert all(is_noise(line) for line in noise) and not any(is_noise(line) for line in kept)
    router = Router()
    for line in noise + kept:
        router.apply(OutputLine("a", "stderr", line))
    assert router.whole.lines("a") == kept
    assert router.whole.lines("a", noise=True) == noise + kept
    assert router.whole.folded["a"] == 4


def test_resource_samples_go_to_the_views_of_their_worker():
    router = Router()
    mine = router.open_call("c0", "launch_workers")
    router.apply(CallStarted("c0", "launch_workers"))
    router.apply(status("a", "running"))
    router.apply(CallStarted("c1", "launch_workers"))
    router.apply(ResourceUse("a", 150.0, 1 << 30, 4 << 30))
    assert mine.usage["a"].cpu_percent == 150.0 and router.calls()[1].usage == {}
