"""What `cmlcluster cleanup` deletes on a cluster: the Secrets (and so the pods and NetworkPolicies) of
sessions that are gone.

A session's Secret says which process the session is (names.origin_annotations) and holds its
controller's connection info. Its Secret is deleted only when origin.state says the session is
gone: of this machine, boot and PID namespace, its process ended, and its controller silent.
Deleting the Secret takes every pod of the session with it, so a live session is never judged
from a hostname and pid alone.
"""

from __future__ import annotations

import contextlib
import logging
from base64 import b64decode
from collections.abc import Callable
from typing import Any

from ... import origin
from ...errors import ConfigError
from . import names
from .manifests import CONNECTION_KEY

log = logging.getLogger(__name__)


def delete_orphans(
    core: Any, namespace: str, delete_pod: Callable[[str], None], *, dry_run: bool, networking: Any = None
) -> list[str]:
    """Delete the Secrets of gone sessions in `namespace`, their pods and, given `networking` (a
    NetworkingV1Api), their NetworkPolicies (the garbage collector would, later; this does it now).
    Returns what was (or, with dry_run, would be) deleted, as "namespace/name"."""
    from kubernetes.client.rest import ApiException

    selector = f"{names.MANAGED_BY_LABEL}={names.MANAGER},{names.COMPONENT_LABEL}=session"
    ended = []
    try:
        secrets = core.list_namespaced_secret(namespace, label_selector=selector, _request_timeout=30).items
    except ApiException as e:
        if e.status != 403:
            raise
        raise ConfigError(
            f"cmlcluster cleanup needs to list Secrets in namespace {namespace!r}, which this user may not "
            f"(kubectl auth can-i list secrets -n {namespace}): ask for it, or delete the pods and Secrets "
            f"labelled {names.MANAGED_BY_LABEL}={names.MANAGER} by hand"
        ) from None
    for secret in secrets:
        controller = controller_of(secret.data or {})
        state = origin.state(names.origin_of(secret.metadata.annotations or {}), controller)
        if state == origin.ANSWERING:
            log.warning(
                "cmlcluster cleanup: left %s/%s alone: its session's process looks gone, but its controller "
                "at %s answers",
                namespace,
                secret.metadata.name,
                controller,
            )
        if state != origin.GONE:
            continue
        session = (secret.metadata.labels or {}).get(names.SESSION_LABEL, "")
        pods = core.list_namespaced_pod(
            namespace, label_selector=f"{names.SESSION_LABEL}={session}", _request_timeout=30
        ).items
        policies = [] if networking is None else _policies_of(networking, namespace, session)
        ended += [f"{namespace}/{pod.metadata.name}" for pod in pods]
        ended += [f"{namespace}/networkpolicy/{name}" for name in policies]
        ended.append(f"{namespace}/{secret.metadata.name}")
        if not dry_run:
            for pod in pods:
                delete_pod(pod.metadata.name)
            for name in policies:
                with contextlib.suppress(Exception):  # gone meanwhile: the garbage collector's, or the session's
                    networking.delete_namespaced_network_policy(name, namespace)
            with contextlib.suppress(Exception):
                core.delete_namespaced_secret(secret.metadata.name, namespace)
    return ended


def _policies_of(networking: Any, namespace: str, session: str) -> list[str]:
    """The names of a session's NetworkPolicies (one, unless it ran with network_policy=False)."""
    selector = f"{names.SESSION_LABEL}={session},{names.MANAGED_BY_LABEL}={names.MANAGER}"
    from kubernetes.client.rest import ApiException

    try:
        found = networking.list_namespaced_network_policy(namespace, label_selector=selector, _request_timeout=30)
    except ApiException as e:
        if e.status != 403:
            raise
        # The Secret owns them: the garbage collector deletes them once it goes.
        log.debug("cmlcluster cleanup: may not list NetworkPolicies in %s; the Secret's deletion takes them", namespace)
        return []
    return [policy.metadata.name for policy in found.items]


def controller_of(data: dict[str, str]) -> str:
    """ "ip:port" of the controller named by a session Secret's data; "" when it names none."""
    try:
        return origin.controller_address(b64decode(data.get(CONNECTION_KEY, "")).decode())
    except ValueError:  # not base64, not UTF-8
        return ""
