"""What is checked before any pod starts: which cluster, which namespace, whether this user may
do what the backend does there, and whether a node can give the GPUs asked for. Every refusal is
a ConfigError that names the value and the fix (a kubectl command to look with).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, install_hint
from .manifests import GPU_RESOURCE
from .pods import api_message, quantity_int

IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
NETWORK_POLICY_GROUP = "networking.k8s.io"
ALWAYS, WITH_POLICY, OPTIONAL, CLEANUP = "always", "network_policy", "optional", "cleanup"


@dataclass(frozen=True)
class Access:
    """One thing the backend asks the API to do in its namespace (a SelfSubjectAccessReview's terms)."""

    verb: str
    resource: str  # "pods", or "pods/log" for a subresource
    why: str  # what the backend does with it, for the refusal
    group: str = ""  # the API group: "" is the core one
    # ALWAYS checked; WITH_POLICY unless network_policy=False; OPTIONAL never (a 403 is handled); CLEANUP
    # never before a session, which does not use it (`cmlcluster cleanup` says which verb it lacks)
    when: str = ALWAYS


# Every call the backend makes to the API, once each (tests/unit/backends/kubernetes/test_manifests.py reads
# the package's calls and checks that this list and they say the same). check_access asks for all
# but the OPTIONAL ones before anything starts.
BACKEND_ACCESS = (
    Access("create", "pods", "start workers"),
    Access("get", "pods", "read the notebook's own pod, which owns the session's Secret"),
    Access("list", "pods", "find the session's pods again after a watch ends, and a gone session's in cleanup"),
    Access("watch", "pods", "follow the session's pods"),
    Access("delete", "pods", "stop workers"),
    Access("get", "pods/log", "quote a failed worker's last lines"),
    Access("create", "secrets", "hold the session's connection info and env= values"),
    Access("patch", "secrets", "add each worker's env= values to the session's Secret"),
    Access("delete", "secrets", "remove the session's Secret when it ends"),
    Access("list", "secrets", "let `cmlcluster cleanup` find the Secrets of sessions that are gone", when=CLEANUP),
    Access("create", "networkpolicies", "admit only the session to its pods", NETWORK_POLICY_GROUP, WITH_POLICY),
    Access("delete", "networkpolicies", "remove the session's NetworkPolicy", NETWORK_POLICY_GROUP, WITH_POLICY),
    Access("list", "networkpolicies", "let `cmlcluster cleanup` find them", NETWORK_POLICY_GROUP, CLEANUP),
    # Handled when refused: the notebook is then admitted by its address alone (with a warning).
    Access("patch", "pods", "label the notebook's own pod for the NetworkPolicy", when=OPTIONAL),
    Access("get", "secrets", "check that image_pull_secrets exist", when=OPTIONAL),  # the kubelet says
    Access("get", "namespaces", "check that the namespace exists", when=OPTIONAL),  # the reviews say
    Access("list", "nodes", "check that a node has the GPUs asked for", when=OPTIONAL),  # the scheduler says
)


def needed_access(network_policy: bool) -> list[Access]:
    """What check_access asks for: every ALWAYS entry, and the WITH_POLICY ones with network_policy."""
    wanted = {ALWAYS, WITH_POLICY} if network_policy else {ALWAYS}
    return [access for access in BACKEND_ACCESS if access.when in wanted]


def load_configuration(configuration: Any) -> tuple[Any, bool]:
    """(a kubernetes.client.Configuration, whether it is this pod's in-cluster one): `configuration`
    itself when given; else the in-cluster config inside a pod, else the kubeconfig's current context.
    ConfigError when the client is not installed or there is no cluster to use."""
    try:
        from kubernetes import client, config
    except ImportError as e:
        hint = install_hint("kubernetes", "'kubernetes>=29'")
        raise ConfigError(f"the kubernetes backend needs the kubernetes client ({e}): {hint}") from e
    if configuration is not None:
        return configuration, False
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
        return configuration, True
    try:
        config.load_kube_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as e:
        raise ConfigError(
            f"no Kubernetes cluster to use: not in a pod, and no kubeconfig ({e}). Point KUBECONFIG at "
            "one (kubectl config view shows the current one), or pass configuration="
        ) from None
    return configuration, False


def default_namespace(in_cluster: bool) -> str:
    """The notebook pod's own namespace in a cluster, else the kubeconfig context's, else "default"."""
    if in_cluster:
        with contextlib.suppress(OSError), open(IN_CLUSTER_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
        return "default"
    from kubernetes import config

    with contextlib.suppress(Exception):
        _, active = config.list_kube_config_contexts()
        return str(active["context"].get("namespace") or "default")
    return "default"


def check_image(image: str) -> None:
    if not image:
        raise ConfigError(
            "image=None: give the worker image pods run, e.g. use_backend('kubernetes', "
            "image='registry.example.com/cmlcluster:1'), or set CMLCLUSTER_KUBERNETES_IMAGE"
        )


def check_access(
    api: Any,
    namespace: str,
    *,
    notebook_pod: str | None,
    image_pull_secrets: Sequence[str],
    network_policy: bool = True,
) -> None:
    """That the API at `api` (an ApiClient) answers, `namespace` exists, this user may do what the
    backend does there (needed_access: BACKEND_ACCESS but what is optional), and the named
    notebook pod and pull Secrets exist."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    host = api.configuration.host
    core = client.CoreV1Api(api)
    try:
        core.read_namespace(namespace, _request_timeout=10)
    except ApiException as e:
        if e.status == 404:
            raise ConfigError(
                f"namespace={namespace!r} does not exist on {host}; create it (kubectl create namespace "
                f"{namespace}) or pass namespace="
            ) from None
        if e.status != 403:  # reading namespaces is not needed: the access review below says the rest
            raise unexpected(f"reading namespace={namespace!r}", e) from None
    except Exception as e:  # connection refused, TLS, DNS
        raise ConfigError(
            f"the Kubernetes API at {host} did not answer ({e}); check the cluster and the kubeconfig's current "
            "context (kubectl cluster-info)"
        ) from None
    review = client.AuthorizationV1Api(api)
    for access in needed_access(network_policy):
        resource, _, subresource = access.resource.partition("/")
        body = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(
                    namespace=namespace,
                    verb=access.verb,
                    resource=resource,
                    subresource=subresource or None,
                    group=access.group,
                )
            )
        )
        try:
            answer = review.create_self_subject_access_review(body, _request_timeout=10)
        except ApiException as e:
            raise unexpected(f"asking whether this user may {access.verb} {access.resource}", e) from None
        verdict = answer.status
        if verdict is None or not verdict.allowed:
            why = f": {verdict.reason}" if verdict is not None and verdict.reason else ""
            policy = access.when == WITH_POLICY
            hint = "; or pass network_policy=False where the namespace's own policies isolate it" if policy else ""
            what = f"{access.resource}.{access.group}" if access.group else access.resource
            raise ConfigError(
                f"this Kubernetes user may not {access.verb} {what} in namespace {namespace!r}{why} (the backend does, "
                f"to {access.why}); ask the cluster's admin for a Role that allows it (kubectl auth can-i "
                f"{access.verb} {what} -n {namespace}){hint}"
            )
    if notebook_pod:
        try:
            core.read_namespaced_pod(notebook_pod, namespace, _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(
                    f"notebook_pod={notebook_pod!r}: no such pod in namespace {namespace!r}; give the "
                    "name of the pod this notebook runs in (its HOSTNAME), or leave it out"
                ) from None
            raise unexpected(f"reading notebook_pod={notebook_pod!r}", e) from None
    for name in image_pull_secrets:
        try:
            core.read_namespaced_secret(name, namespace, _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(
                    f"image_pull_secrets: Secret {name!r} does not exist in namespace {namespace!r}; create "
                    f"it (kubectl create secret docker-registry {name} ...) or leave it out"
                ) from None
            if e.status != 403:  # may not read Secrets: the kubelet will say if it is missing
                raise unexpected(f"reading image pull Secret {name!r}", e) from None


def check_gpus(core: Any, per_worker: int) -> None:
    """That some node advertises `per_worker` GPUs (core: a CoreV1Api); nothing said when nodes may not be read."""
    from kubernetes.client.rest import ApiException

    try:
        nodes = core.list_node(_request_timeout=10).items
    except ApiException as e:
        if e.status == 403:
            return  # nodes are cluster-scoped and often not readable: the scheduler will say
        raise unexpected(f"listing nodes to check nvidia_gpu={per_worker}", e) from None
    most = max((quantity_int((n.status.allocatable or {}).get(GPU_RESOURCE)) for n in nodes), default=0)
    if most == 0:
        raise ConfigError(
            f"nvidia_gpu={per_worker}: no node of this cluster advertises {GPU_RESOURCE}; install the "
            "NVIDIA device plugin on its GPU nodes, or ask for nvidia_gpu=0"
        )
    if per_worker > most:
        raise ConfigError(
            f"nvidia_gpu={per_worker}: the node with the most GPUs has {most}; ask for {most} or fewer per worker"
        )


def unexpected(doing: str, e: Any) -> ConfigError:
    """An answer the checks did not expect, refused before anything starts with the API's words."""
    return ConfigError(
        f"{doing}, the Kubernetes API answered {e.status}: {api_message(e)}; check the cluster and this user's "
        "access (kubectl auth can-i --list)"
    )
