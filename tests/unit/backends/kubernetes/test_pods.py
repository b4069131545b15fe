"""The Kubernetes backend's readers of pods (backends/kubernetes/pods.py), on pod JSON in the shape
the API returns it (tests/unit/data/kubernetes_pods/), turned into the client's V1Pod models the
way the backend's watch gets them: by the client's own Watch.unmarshal_event.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import kubernetes_validate  # the dev extra's; no skip when missing: these tests must run
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from cmlcluster.backends.kubernetes import pods

DATA = pathlib.Path(__file__).parents[2] / "data" / "kubernetes_pods"
RECORDED = sorted(path.stem for path in DATA.glob("*.json"))


def raw(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def as_watched(pod: dict[str, Any], kind: str = "MODIFIED") -> Any:
    """`pod` as the backend's watch hands it on: a watch event's line, deserialized by the client."""
    w = watch.Watch()
    return_type = w.get_return_type(client.CoreV1Api(client.ApiClient()).list_namespaced_pod)
    event = w.unmarshal_event(json.dumps({"type": kind, "object": pod}), return_type)
    assert event["type"] == kind
    return event["object"]


def pod(name: str) -> Any:
    return as_watched(raw(name))


def test_the_recorded_pods_are_pods_by_the_apis_schema():
    assert {"running", "succeeded", "oom_killed", "unschedulable", "image_pull_backoff", "evicted"} <= set(RECORDED)
    for name in RECORDED:
        for version in ("1.29.0", "1.37.0"):
            kubernetes_validate.validate(raw(name), version, strict=True)
        assert isinstance(pod(name), client.V1Pod), name


# ---------------------------------------------------------------- the container's state


def test_container_state_of_a_running_pod():
    state = pods.container_state(pod("running"))
    assert state.running is not None and state.terminated is None and state.waiting is None
    assert state.running.started_at.isoformat() == "2024-05-14T09:12:05+00:00"


def test_container_state_of_an_ended_pod_has_its_exit_code():
    assert pods.container_state(pod("succeeded")).terminated.exit_code == 0
    assert pods.container_state(pod("oom_killed")).terminated.exit_code == 137
    assert pods.container_state(pod("deleted_by_signal")).terminated.exit_code == 143


def test_no_container_state_before_the_kubelet_reports_one_or_for_another_container():
    assert pods.container_state(pod("unschedulable")) is None  # never placed: no containerStatuses
    sidecar = raw("running")
    sidecar["status"]["containerStatuses"][0]["name"] = "istio-proxy"
    assert pods.container_state(as_watched(sidecar)) is None
    bare = raw("running")
    del bare["status"]
    assert pods.container_state(as_watched(bare)) is None


# ---------------------------------------------------------------- why it ended


def ended(name: str) -> tuple[int, str | None]:
    """(the contract's exit code, the reason) of a recorded pod that ended, as the watch reads them."""
    p = pod(name)
    terminated = pods.container_state(p).terminated
    return pods.contract_code(terminated.exit_code), pods.termination_reason(terminated, p)


def test_an_oom_killed_container_says_so_with_its_memory_limit():
    assert ended("oom_killed") == (-9, "OOMKilled: it used more than its memory limit of 1536Mi")


def test_an_oom_killed_container_without_a_limit_says_so_without_one():
    unlimited = raw("oom_killed")
    del unlimited["spec"]["containers"][0]["resources"]
    p = as_watched(unlimited)
    assert pods.memory_limit(p) is None
    assert pods.termination_reason(pods.container_state(p).terminated, p) == (
        "OOMKilled: it used more than its memory limit"
    )


def test_a_container_that_completed_or_was_stopped_by_a_signal_leaves_it_to_the_exit_code():
    assert ended("succeeded") == (0, None)  # reason "Completed"
    assert ended("deleted_by_signal") == (-15, None)  # reason "Error", exit 143: SIGTERM


def test_an_evicted_pod_says_the_kubelets_words_though_its_container_only_says_error():
    code, reason = ended("evicted")
    assert code == -9
    assert reason is not None and reason.startswith("Evicted: The node was low on resource: ephemeral-storage.")


def test_a_container_that_could_not_start_says_the_runtimes_words():
    code, reason = ended("start_error")
    assert code == 128
    assert reason is not None and reason.startswith("StartError: failed to create containerd task")
    assert 'exec: "python3": executable file not found in $PATH' in reason


def test_pod_reason():
    assert pods.pod_reason(pod("running")) is None
    assert pods.pod_reason(pod("oom_killed")) is None  # the container says it, not the pod
    assert pods.pod_reason(pod("evicted")).startswith("Evicted: The node was low on resource")
    deadline = raw("running")
    deadline["status"].update(phase="Failed", reason="DeadlineExceeded")
    assert pods.pod_reason(as_watched(deadline)) == "DeadlineExceeded"  # no message: the reason alone


@pytest.mark.parametrize(
    "code, contract",
    [(0, 0), (1, 1), (128, 128), (137, -9), (143, -15), (129, -1), (192, -64), (193, 193), (255, 255), (None, 255)],
)
def test_contract_code(code, contract):
    assert pods.contract_code(code) == contract
    assert pods.NO_EXIT_CODE == 255


# ---------------------------------------------------------------- why it will not start


def test_an_image_that_cannot_be_pulled_is_fatal_with_the_kubelets_words():
    assert pods.fatal_waiting(pod("image_pull_backoff")) == (
        'ImagePullBackOff: Back-off pulling image "registry.example.com/cmlcluster-worker:no-such-tag"'
    )


def test_a_first_failed_pull_is_not_fatal_the_kubelet_retries_it():
    first = raw("image_pull_backoff")
    first["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] = "ErrImagePull"
    assert pods.fatal_waiting(as_watched(first)) is None


def test_a_fatal_wait_without_a_message_says_so():
    config = raw("image_pull_backoff")
    config["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "CreateContainerConfigError"}}
    assert pods.fatal_waiting(as_watched(config)) == "CreateContainerConfigError: no message"


@pytest.mark.parametrize("name", ["running", "succeeded", "unschedulable", "oom_killed"])
def test_nothing_fatal_in_a_pod_that_is_not_waiting(name):
    assert pods.fatal_waiting(pod(name)) is None


def test_an_unschedulable_pod_gives_the_schedulers_message():
    assert pods.unschedulable(pod("unschedulable")) == (
        "0/3 nodes are available: 1 node(s) had untolerated taint {node-role.kubernetes.io/control-plane: }, "
        "2 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 1 Preemption is not helpful for "
        "scheduling, 2 No preemption victims found for incoming pod."
    )


def test_an_unschedulable_pod_without_a_message_still_counts():
    silent = raw("unschedulable")
    del silent["status"]["conditions"][0]["message"]
    assert pods.unschedulable(as_watched(silent)) == "no node fits the pod"


@pytest.mark.parametrize("name", ["running", "image_pull_backoff", "evicted"])
def test_a_scheduled_pod_is_not_unschedulable(name):
    assert pods.unschedulable(pod(name)) is None


def test_a_pod_merely_not_yet_scheduled_is_not_unschedulable():
    waiting = raw("unschedulable")
    condition = waiting["status"]["conditions"][0]
    condition["reason"] = "SchedulingGated"
    assert pods.unschedulable(as_watched(waiting)) is None


# ---------------------------------------------------------------- other readers


def test_memory_limit_reads_the_worker_container():
    assert pods.memory_limit(pod("running")) == "1536Mi"
    assert pods.memory_limit(pod("unschedulable")) == "4Gi"
    other = raw("running")
    other["spec"]["containers"][0]["name"] = "istio-proxy"
    assert pods.memory_limit(as_watched(other)) is None


@pytest.mark.parametrize("value, expected", [("8", 8), ("0", 0), (None, 0), ("500m", 0), ("1Ki", 0), (2, 2)])
def test_quantity_int(value, expected):
    assert pods.quantity_int(value) == expected


def test_api_message_is_the_status_bodys_message():
    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": 'pods is forbidden: User "alice" cannot create resource "pods" in API group "" in the '
            'namespace "ml-team"',
            "reason": "Forbidden",
            "details": {"kind": "pods"},
            "code": 403,
        }
    )
    assert pods.api_message(forbidden) == (
        'pods is forbidden: User "alice" cannot create resource "pods" in API group "" in the namespace "ml-team"'
    )


@pytest.mark.parametrize("body", [None, "", "<html>502 Bad Gateway</html>", '{"kind": "Status"}', "[1]"])
def test_api_message_without_a_status_body_is_the_status_and_reason(body):
    e = ApiException(status=502, reason="Bad Gateway")
    e.body = body
    assert pods.api_message(e) == "502 Bad Gateway"
