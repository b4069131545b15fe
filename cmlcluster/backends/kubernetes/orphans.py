"""What `cmlcluster cleanup` deletes on a cluster: the Secrets (and so the pods) of sessions that are gone.

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
from . import names
from .manifests import CONNECTION_KEY

log = logging.getLogger(__name__)


def delete_orphans(core: Any, namespace: str, delete_pod: Callable[[str], None], *, dry_run: bool) -> list[str]:
    """Delete the Secrets of gone sessions in `namespace`, and their pods (the garbage collector would,
    later; `delete_pod(name)` does it now). Returns what was (or, with dry_run, would be) deleted,
    as "namespace/name"."""
    selector = f"{names.MANAGED_BY_LABEL}={names.MANAGER},{names.COMPONENT_LABEL}=session"
    ended = []
    for secret in core.list_namespaced_secret(namespace, label_selector=selector, _request_timeout=30).items:
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
        ended += [f"{namespace}/{pod.metadata.name}" for pod in pods]
        ended.append(f"{namespace}/{secret.metadata.name}")
        if not dry_run:
            for pod in pods:
                delete_pod(pod.metadata.name)
            with contextlib.suppress(Exception):
                core.delete_namespaced_secret(secret.metadata.name, namespace)
    return ended


def controller_of(data: dict[str, str]) -> str:
    """ "ip:port" of the controller named by a session Secret's data; "" when it names none."""
    try:
        return origin.controller_address(b64decode(data.get(CONNECTION_KEY, "")).decode())
    except ValueError:  # not base64, not UTF-8
        return ""
