"""A session's own objects in its namespace, besides its pods: its Secret and its NetworkPolicy.

The Secret carries the controller's connection info and the workers' env= values, and owns every
worker pod (the garbage collector removes what a dead session left once it goes; it is owned in
turn by the notebook's pod when the notebook runs in the cluster). The NetworkPolicy admits to the
session's pods only its own pods and the notebook: its addresses, and its pod by a label that pod
alone has (names.POD_UID_LABEL, put there by the session where it may patch pods). Both are made
with the first pod, before it, so that no pod is ever unprotected, and deleted when the session closes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ...errors import BackendError
from ...origin import this_process
from ...workers import WorkerSpec
from . import manifests, names
from .options import PodOptions
from .pods import api_message

MERGE_PATCH = "application/merge-patch+json"  # adds keys to a Secret, leaving the others as they are

log = logging.getLogger(__name__)
_warned_unlabelled: set[str] = set()  # notebook pods warned about already (no label of their own): once each


class SessionObjects:
    """The Secret and NetworkPolicy of one session (the client's calls block: call from a thread)."""

    def __init__(
        self,
        core: Callable[[], Any],
        networking: Callable[[], Any],
        namespace: str,
        session_id: str,
        options: PodOptions,
        notebook_pod: str,
        controller_ip: Callable[[], str],
    ):
        self._core, self._networking = core, networking
        self.namespace, self.session_id, self.options = namespace, session_id, options
        self._notebook_pod_name, self._controller_ip = notebook_pod, controller_ip
        self._secret: dict[str, Any] | None = None  # {"name", "uid"}, once created
        self._policy: str | None = None  # its name, once created
        self._lock = threading.Lock()

    def secret(self, connection_info: str, spec: WorkerSpec) -> dict[str, Any]:
        """{"name", "uid"} of the session's Secret (created, with the NetworkPolicy, by the first
        worker), holding `spec`'s env= values too: they join it before its pod references them,
        never the pod spec. Raises the client's ApiException."""
        with self._lock:
            if self._secret is None:
                notebook = self._notebook_pod()
                owner = None if notebook is None else {"name": notebook["name"], "uid": notebook["uid"]}
                body = manifests.session_secret(
                    self.session_id,
                    namespace=self.namespace,
                    connection_info=connection_info,
                    owner=owner,
                    origin=(socket.gethostname(), os.getpid()),
                )
                body["metadata"].setdefault("annotations", {}).update(names.origin_annotations(this_process()))
                created = self._core().create_namespaced_secret(self.namespace, body)
                self._secret = {"name": created.metadata.name, "uid": created.metadata.uid}
                if self.options.network_policy:
                    self._create_policy(self._secret, notebook)
        data = {"data": manifests.env_secret_data(spec, self.options)}
        if data["data"]:
            self._core().patch_namespaced_secret(self._secret["name"], self.namespace, data, _content_type=MERGE_PATCH)
        return self._secret

    def _create_policy(self, secret: dict[str, Any], notebook: dict[str, Any] | None) -> None:
        from kubernetes.client.rest import ApiException

        ips = [self._controller_ip()] + ([notebook["ip"]] if notebook is not None and notebook["ip"] else [])
        body = manifests.network_policy(
            self.session_id,
            namespace=self.namespace,
            secret_name=secret["name"],
            secret_uid=secret["uid"],
            notebook_ips=ips,
            notebook_selector=None if notebook is None else self._notebook_selector(notebook, ips),
            options=self.options,
        )
        try:
            self._networking().create_namespaced_network_policy(self.namespace, body)
        except ApiException as e:
            raise BackendError(
                f"could not create the session's NetworkPolicy: {api_message(e)}; where the cluster's own policies "
                "isolate the namespace, pass network_policy=False"
            ) from e
        self._policy = body["metadata"]["name"]

    def _notebook_selector(self, notebook: dict[str, Any], ips: list[str]) -> dict[str, str] | None:
        """Labels that select the notebook's pod and no other, for the NetworkPolicy to admit it by:
        a StatefulSet pod's own name, else its uid under names.POD_UID_LABEL (added here, where this
        user may patch pods). Never all of its labels: every replica of its Deployment has them
        too. None (and a warning, once per pod) when there is none: the policy then admits the
        notebook by its address alone, which some network plugins do not match for pods."""
        from kubernetes.client.rest import ApiException

        name, uid, labels = notebook["name"], notebook["uid"], notebook["labels"]
        if labels.get(names.STATEFULSET_POD_NAME_LABEL) == name:
            return {names.STATEFULSET_POD_NAME_LABEL: name}
        if labels.get(names.POD_UID_LABEL) != uid:
            patch = {"metadata": {"labels": {names.POD_UID_LABEL: uid}}}
            try:
                self._core().patch_namespaced_pod(
                    name, self.namespace, patch, _content_type=MERGE_PATCH, _request_timeout=10
                )
            except ApiException as e:
                if name not in _warned_unlabelled:
                    _warned_unlabelled.add(name)
                    log.warning(
                        "cmlcluster: this notebook's pod %r has no label of its own (every replica of its Deployment "
                        "has the same ones) and could not be given one (%s: %s): the session's NetworkPolicy admits "
                        "it by its address alone (%s), which some network plugins (Cilium) do not match for pods. "
                        "Let this user patch pods (kubectl auth can-i patch pods -n %s), or admit the notebook with "
                        "allow_from=",
                        name,
                        e.status,
                        e.reason,
                        ", ".join(ips),
                        self.namespace,
                    )
                return None
        return {names.POD_UID_LABEL: uid}

    def _notebook_pod(self) -> dict[str, Any] | None:
        """{"name", "uid", "labels", "ip"} of the pod this notebook runs in, to own the session's
        Secret and be let in by its NetworkPolicy; None outside one."""
        if not self._notebook_pod_name:
            return None
        from kubernetes.client.rest import ApiException

        try:
            pod = self._core().read_namespaced_pod(self._notebook_pod_name, self.namespace, _request_timeout=10)
        except ApiException as e:
            log.warning(
                "cmlcluster: could not read this notebook's pod %r (%s): its workers will not go with it if it dies",
                self._notebook_pod_name,
                e.reason,
            )
            return None
        return {
            "name": pod.metadata.name,
            "uid": pod.metadata.uid,
            "labels": dict(pod.metadata.labels or {}),
            "ip": (pod.status.pod_ip if pod.status is not None else None) or "",
        }

    def delete(self) -> None:
        """Delete the NetworkPolicy, then the Secret, and with it (the garbage collector) any pod left."""
        policy, self._policy = self._policy, None
        if policy is not None:  # the garbage collector would take it with the Secret; now is sooner
            try:
                self._networking().delete_namespaced_network_policy(policy, self.namespace)
            except Exception as e:
                if getattr(e, "status", None) != 404:
                    log.warning("cmlcluster: could not delete the session's NetworkPolicy %s: %s", policy, e)
        secret, self._secret = self._secret, None
        if secret is not None:
            try:
                self._core().delete_namespaced_secret(secret["name"], self.namespace, propagation_policy="Background")
            except Exception as e:  # not found (deleted already), or the API is gone
                log.warning("cmlcluster: could not delete the session's Secret %s: %s", secret["name"], e)
