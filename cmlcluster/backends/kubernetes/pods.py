"""What the API's answers say: pure readers of the client's model objects (V1Pod as a list or a
watch delivers it, a node's allocatable quantities, an ApiException's body).

Nothing here calls the API or changes what it reads; tests/unit/backends/kubernetes/test_pods.py runs
each reader on recorded pod JSON, deserialized as the watch does it.
"""

from __future__ import annotations

import json
from typing import Any

from ..base import signal_exit_code
from .names import CONTAINER_NAME

# A pod that ended without its container exiting (never scheduled, image never pulled, deleted
# before it ran) has no exit code; the contract needs one, and exit_reason says what happened.
NO_EXIT_CODE = 255
# A container waiting for one of these reasons will not start without someone changing something.
# (Not ErrImagePull: a registry's rate limit or timeout is one too; the kubelet retries, and says
# ImagePullBackOff once the pull has failed again.)
FATAL_WAITING_REASONS = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)


def container_state(pod: Any) -> Any:
    """The worker container's V1ContainerState, or None before the kubelet has reported one."""
    statuses = (pod.status.container_statuses if pod.status is not None else None) or []
    for status in statuses:
        if status.name == CONTAINER_NAME:
            return status.state
    return None


def termination_reason(terminated: Any, pod: Any) -> str | None:
    """Why the container ended (its V1ContainerStateTerminated), where its exit code does not say it."""
    reason = terminated.reason
    if reason == "OOMKilled":
        limit = memory_limit(pod)
        return f"OOMKilled: it used more than its memory limit{f' of {limit}' if limit else ''}"
    if reason in (None, "Error", "Completed"):  # the exit code says it
        return pod_reason(pod)
    return f"{reason}: {terminated.message}" if terminated.message else reason


def pod_reason(pod: Any) -> str | None:
    """Why the pod as a whole ended (Evicted, DeadlineExceeded...), if it says."""
    status = pod.status
    if status is None or not status.reason:
        return None
    return f"{status.reason}: {status.message}" if status.message else status.reason


def fatal_waiting(pod: Any) -> str | None:
    """Why the container will not start as it is (its image cannot be pulled, say), else None."""
    state = container_state(pod)
    waiting = state.waiting if state is not None else None
    if waiting is None or waiting.reason not in FATAL_WAITING_REASONS:
        return None
    return f"{waiting.reason}: {waiting.message or 'no message'}"


def unschedulable(pod: Any) -> str | None:
    """The scheduler's message for a pod it cannot place, else None."""
    for condition in (pod.status.conditions if pod.status is not None else None) or []:
        if condition.type == "PodScheduled" and condition.status == "False" and condition.reason == "Unschedulable":
            return condition.message or "no node fits the pod"
    return None


def memory_limit(pod: Any) -> str | None:
    """The worker container's memory limit as the pod spec says it ("4Gi"), else None."""
    for container in pod.spec.containers if pod.spec is not None else []:
        if container.name == CONTAINER_NAME and container.resources and container.resources.limits:
            return container.resources.limits.get("memory")
    return None


def contract_code(code: int | None) -> int:
    """A container killed by signal N exits 128+N (the runtime's convention); the contract says -N."""
    if code is None:
        return NO_EXIT_CODE
    return signal_exit_code(int(code))


def quantity_int(value: Any) -> int:
    """A whole-number quantity ("8", a node's nvidia.com/gpu), 0 when absent or not a whole number."""
    try:
        return int(str(value)) if value is not None else 0
    except ValueError:
        return 0


def api_message(e: Any) -> str:
    """The API's own message from an ApiException (its Status body), else its status and reason."""
    try:
        return str(json.loads(e.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"
