"""Pod and Secret manifests for the Kubernetes backend, as plain dicts (the JSON the API takes).

Pure functions: no kubernetes client, no API calls, nothing read from the environment. The
backend sends what they return; the tests validate it against the API's OpenAPI schemas.
What the objects are called and labelled is in ``names``; the options checked for every pod in
``options``.

The objects of one session:

- one Secret, ``cmlcluster-<session>``, holding the controller's connection info, and each worker's
  env= values (keys "env.<engine id>.<NAME>", added as workers start). When the
  notebook runs in a pod, that pod owns the Secret. (No SSH key: for Horovod the session runs
  horovodrun itself and holds the private key; workers get only the public key, over the control
  plane, for their sshd.)
- one Pod per worker, ``cmlcluster-<session>-<engine>`` (the worker id already starts with the
  session id), owned by the Secret, with the Secret mounted read-only at SESSION_MOUNT_PATH. Pods
  pass Pod Security "restricted" (pod_security_context, container_security_context).
- one NetworkPolicy, named as the Secret and owned by it, that admits to the session's pods only
  its own pods and the notebook (network_policy; unless PodOptions.network_policy is False).

So Kubernetes' garbage collector removes every worker when the Secret goes, and the Secret
when the notebook's pod goes: a session that dies leaves nothing running. Secrets reach the
worker as files, never as environment variables: a pod's env is readable by anyone who may
`get pods` in the namespace, and is inherited by every process the user's code starts. What
the user asked to be a variable (env=) is one, but the pod spec holds only a reference to the
Secret's key (secretKeyRef), never the value.

Owner references set ``controller`` only where the owner manages the object (the Secret, for
its workers; the notebook's pod does not manage the Secret) and never ``blockOwnerDeletion``:
where the OwnerReferencesPermissionEnforcement admission plugin is on, setting it needs
`update` on the owner's finalizers, which a notebook's service account rarely has, and it only
matters to foreground deletion. The backend deletes its pods itself at teardown; the garbage
collector is the safety net. (Spark on Kubernetes owns executor pods by its driver the same way.)
"""

from __future__ import annotations

import math
import posixpath
from base64 import b64encode
from collections.abc import Mapping, Sequence
from typing import Any

from ... import checks
from ...errors import ConfigError
from ...wire import CONNECTION_ENV, CONNECTION_FILE_ENV
from ...workers import Resources, WorkerSpec
from .names import (
    COMPONENT_LABEL,
    CONTAINER_NAME,
    HOST_ANNOTATION,
    PID_ANNOTATION,
    SESSION_MOUNT_PATH,
    pod_name,
    secret_name,
    session_labels,
    worker_labels,
)
from .options import RESERVED_ENV, RESERVED_ENV_PREFIX, PodOptions

# The session Secret, as files in every worker. The agent reads its connection info from the file
# that CONNECTION_FILE_ENV names.
SESSION_VOLUME = "cmlcluster-session"
# Read-only to its owner and the pod's fsGroup, which owns a Secret volume's files: a worker under
# a uid the cluster picks (OpenShift's random one) reads it as a member of that group.
SESSION_FILE_MODE = 0o440
CONNECTION_KEY = "connection.json"
CONNECTION_FILE = f"{SESSION_MOUNT_PATH}/{CONNECTION_KEY}"
# The worker's variables that may be secrets (env=) are keys of the same Secret, referenced by its pod.
ENV_KEY_PREFIX = "env."
MAX_SECRET_KEY = 253

SHARED_VOLUME = "cmlcluster-shared"
# A worker's own working folder (an emptyDir) when the session's is not on the shared volume: where
# shipped files land, never the image's folder (often "/").
WORK_VOLUME = "cmlcluster-work"
WORK_PATH = "/var/cmlcluster/work"
GPU_RESOURCE = "nvidia.com/gpu"
EPHEMERAL_STORAGE = "ephemeral-storage"
NETWORK_POLICY_API = "networking.k8s.io/v1"


# ---------------------------------------------------------------- quantities


def cpu_quantity(cpu: float) -> str:
    """CPUs as a Kubernetes quantity: "2", "500m".

    Kubernetes counts CPU in millicores and rounds a finer amount up, so this does too (docker's
    nano_cpus would keep it). round() first: 4.03 * 1000 is 4030.0000000000005 in floating point.
    """
    if not checks.number(cpu, above=0):
        raise ConfigError(f"cpu={cpu!r}: must be a number greater than 0, e.g. cpu=1")
    millicores = math.ceil(round(cpu * 1000, 6))
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"


def memory_quantity(resources: Resources) -> str:
    """A worker's memory as a Kubernetes quantity: "4Gi", "1536Mi": docker's whole MiB
    (Resources.memory_mib), in "Gi" when they make whole GiB."""
    memory = resources.memory
    if not checks.number(memory, above=0):
        raise ConfigError(f"memory={memory!r}: memory (GB) must be a number greater than 0, e.g. memory=1")
    mib = resources.memory_mib
    if mib < 1:
        raise ConfigError(f"memory={memory!r}: less than 1 MiB; memory is in GB, e.g. memory=0.5 for 512 MiB")
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


# ---------------------------------------------------------------- manifests


def owner_reference(api_version: str, kind: str, name: str, uid: str, *, controller: bool) -> dict[str, Any]:
    """An ownerReference; blockOwnerDeletion is never set (see the module's docstring)."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": controller,
        "blockOwnerDeletion": False,
    }


def _encode(text: str) -> str:
    return b64encode(text.encode()).decode("ascii")


def session_secret(
    session_id: str,
    *,
    namespace: str,
    connection_info: str,
    owner: Mapping[str, str] | None = None,
    origin: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """The session's Secret: the controller's connection info for its workers.

    owner: {"name": ..., "uid": ...} of the notebook's own pod, when the notebook runs in one:
    the Secret, and with it every worker, then goes when that pod goes.
    origin: (host name, pid) of the session's process, for `cmlcluster cleanup` on that host.

    The values are in ``data`` (base64), not ``stringData``: that is what the API stores and
    returns, so a manifest reads the same as the object read back.
    """
    if not isinstance(connection_info, str) or not connection_info:
        raise ConfigError("connection_info: the controller's connection info is empty; start the controller first")
    data = {CONNECTION_KEY: _encode(connection_info)}
    metadata: dict[str, Any] = {
        "name": secret_name(session_id),
        "namespace": namespace,
        "labels": {**session_labels(session_id), COMPONENT_LABEL: "session"},
    }
    if origin is not None:
        metadata["annotations"] = {HOST_ANNOTATION: origin[0], PID_ANNOTATION: str(origin[1])}
    if owner is not None:
        name, uid = owner.get("name"), owner.get("uid")
        if not name or not uid:
            raise ConfigError(f"owner={dict(owner)!r}: the notebook's pod needs both its 'name' and its 'uid'")
        # The notebook's pod does not manage the Secret (its own controller, if any, manages it).
        metadata["ownerReferences"] = [owner_reference("v1", "Pod", name, uid, controller=False)]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "data": data}


def worker_resources(spec: WorkerSpec, options: PodOptions | None = None) -> dict[str, dict[str, str]]:
    """Requests equal to limits (the Guaranteed QoS class: the pod gets what it asked for, as in
    CML); GPUs only when asked for: a parameter server's Resources have nvidia_gpu=0. Local disk
    (ephemeral-storage) is requested, not limited: the working folder's sizeLimit bounds what matters."""
    options = options or PodOptions()
    amounts = {"cpu": cpu_quantity(spec.resources.cpu), "memory": memory_quantity(spec.resources)}
    gpus = spec.resources.nvidia_gpu
    if not checks.whole(gpus, 0):
        raise ConfigError(f"nvidia_gpu={gpus!r}: must be a whole number of GPUs, 0 or more")
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    storage = options.ephemeral_storage or options.work_size
    return {"requests": {**amounts, EPHEMERAL_STORAGE: storage}, "limits": dict(amounts)}


def is_own_variable(name: str) -> bool:
    """Whether cmlcluster sets `name` in every worker (ids, addresses, file paths: nothing secret)."""
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX)


def env_secret_key(spec: WorkerSpec, name: str) -> str:
    """The session Secret's key holding variable `name` of this worker: "env.<engine id>.<name>"."""
    key = f"{ENV_KEY_PREFIX}{spec.engine_id}.{name}"
    if len(key) > MAX_SECRET_KEY:
        raise ConfigError(f"env key {name!r} is too long for a Kubernetes Secret's key; use a shorter name")
    return key


def _user_env(spec: WorkerSpec, options: PodOptions) -> dict[str, str]:
    """The worker's variables that are not cmlcluster's own: the options' env, then the launch's env=."""
    env = {name: value for name, value in options.env.items() if not is_own_variable(name)}
    env.update((name, value) for name, value in spec.env.items() if not is_own_variable(name))
    return env


def env_secret_data(spec: WorkerSpec, options: PodOptions) -> dict[str, str]:
    """What the session's Secret holds for this worker's pod to reference ({key: base64 value}):
    every variable that is not cmlcluster's own (env=, the options' env), which may be a secret."""
    return {env_secret_key(spec, name): _encode(value) for name, value in _user_env(spec, options).items()}


def worker_env(spec: WorkerSpec, options: PodOptions, secret_name: str) -> list[dict[str, Any]]:
    """The worker's variables: cmlcluster's own by value; env= and the options' env by reference to
    the session's Secret (env_secret_data): `get pods` and the pod's YAML never show their values.
    The connection info is a file in the Secret (CONNECTION_FILE_ENV names it)."""
    own = {name: value for name, value in spec.env.items() if is_own_variable(name) and name != CONNECTION_ENV}
    own[CONNECTION_FILE_ENV] = CONNECTION_FILE
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in own.items()]
    for name in _user_env(spec, options):
        reference = {"name": secret_name, "key": env_secret_key(spec, name)}
        env.append({"name": name, "valueFrom": {"secretKeyRef": reference}})
    return env


def pod_security_context(options: PodOptions) -> dict[str, Any]:
    """What Pod Security "restricted" asks of the pod as a whole: a non-root user (the image's, the
    one the cluster assigns, or run_as_user) and the runtime's default seccomp profile; fs_group
    owns the volumes, so that whatever uid the worker gets reads the Secret and writes its folder."""
    context: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if options.run_as_user is not None:
        context["runAsUser"] = options.run_as_user
    if options.fs_group is not None:
        context["fsGroup"] = options.fs_group
    return context


def container_security_context() -> dict[str, Any]:
    """What "restricted" asks of each container: no privilege escalation (a setuid binary gains
    nothing), and no capabilities. Nothing in a worker needs root: sshd for Horovod runs as the
    worker's user on port 2222."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def network_policy(
    session_id: str,
    *,
    namespace: str,
    secret_name: str,
    secret_uid: str,
    notebook_ips: Sequence[str] = (),
    notebook_selector: Mapping[str, str] | None = None,
    options: PodOptions | None = None,
) -> dict[str, Any]:
    """The session's NetworkPolicy: connections to its worker pods only from its own pods (TF,
    torch, Horovod and sshd talk to each other on every port), from the notebook (horovodrun's
    ssh, rendezvous), and from options.allow_from. Egress is left alone: workers connect out to
    the session's controller. Owned by the Secret, so it goes with the session.

    The notebook is admitted by its addresses (notebook_ips: the controller's, and its pod's) and,
    when it runs in a pod of this namespace, by notebook_selector: labels that select that pod
    alone (names.POD_UID_LABEL, or a StatefulSet pod's own name), never all of the pod's labels,
    which every replica of its Deployment shares. Some network plugins (Cilium) match ipBlock
    only to addresses outside the cluster, so the selector is what admits a notebook in a pod
    there. A policy's podSelector peer without a namespaceSelector means this namespace's pods only.
    """
    options = options or PodOptions()
    pods = {"matchLabels": {**session_labels(session_id), COMPONENT_LABEL: "worker"}}
    peers: list[dict[str, Any]] = [{"podSelector": pods}]
    if notebook_selector:  # never empty: an empty selector admits every pod of the namespace
        peers.append({"podSelector": {"matchLabels": dict(notebook_selector)}})
    for ip in dict.fromkeys(notebook_ips):
        prefix = 128 if ":" in ip else 32
        peers.append({"ipBlock": {"cidr": f"{ip}/{prefix}"}})
    peers += [dict(peer) for peer in options.allow_from]
    return {
        "apiVersion": NETWORK_POLICY_API,
        "kind": "NetworkPolicy",
        "metadata": {
            "name": secret_name,
            "namespace": namespace,
            "labels": {**session_labels(session_id), COMPONENT_LABEL: "network-policy"},
            "ownerReferences": [owner_reference("v1", "Secret", secret_name, secret_uid, controller=True)],
        },
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": [{"from": peers}]},
    }


def worker_pod(
    spec: WorkerSpec,
    *,
    session_id: str,
    namespace: str,
    image: str,
    secret_name: str,
    secret_uid: str,
    options: PodOptions | None = None,
) -> dict[str, Any]:
    """The Pod of one worker: the agent (spec.argv) in `image`, with spec's resources and env.

    secret_name, secret_uid: the session's Secret (created first: its uid is the owner reference).
    The container's command and env are the spec's, as docker/backend.py sends them, except that the
    controller's connection info is read from the mounted Secret instead of the environment, and
    env= values are references to the Secret's keys (env_secret_data, added before the pod).
    """
    options = options or PodOptions()
    if not isinstance(image, str) or not image.strip():
        raise ConfigError(f"image={image!r}: give the worker image, e.g. image='registry.example.com/cmlcluster:1'")
    mounts: list[dict[str, Any]] = [{"name": SESSION_VOLUME, "mountPath": SESSION_MOUNT_PATH, "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": SESSION_VOLUME, "secret": {"secretName": secret_name, "defaultMode": SESSION_FILE_MODE}}
    ]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": list(spec.argv),
        "env": worker_env(spec, options, secret_name),
        "resources": worker_resources(spec, options),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    shared = options.shared_volume
    if shared is not None:
        mounts.append({"name": SHARED_VOLUME, "mountPath": shared.mount_path})
        volumes.append({"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": shared.claim}})
    # The session's folder is the workers' working folder only where they see it: on the shared
    # volume. Elsewhere each worker has a folder of its own, and programs are shipped (Capabilities.sees).
    cwd = posixpath.normpath(spec.cwd)
    if shared is not None and shared.holds(cwd):
        container["workingDir"] = cwd
    else:
        mounts.append({"name": WORK_VOLUME, "mountPath": WORK_PATH})
        volumes.append({"name": WORK_VOLUME, "emptyDir": {"sizeLimit": options.work_size}})
        container["workingDir"] = WORK_PATH
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a worker that ends is done: the session reports its exit
        "containers": [container],
        "volumes": volumes,
        # The pause container is PID 1 and reaps orphans, as docker's --init does for docker workers:
        # the agent is not PID 1 (which ignores signals it has no handler for).
        "shareProcessNamespace": True,
        # No variables for every Service in the namespace: they can be many and clash with the user's.
        "enableServiceLinks": False,
        # Workers run the user's code and need no API access, unless a service account is chosen for them.
        "automountServiceAccountToken": options.service_account is not None,
        "securityContext": pod_security_context(options),
    }
    if options.service_account is not None:
        pod_spec["serviceAccountName"] = options.service_account
    if options.node_selector:
        pod_spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in options.tolerations]
    if options.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in options.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(spec.worker_id),
            "namespace": namespace,
            "labels": worker_labels(session_id, spec.worker_id),
            "ownerReferences": [owner_reference("v1", "Secret", secret_name, secret_uid, controller=True)],
        },
        "spec": pod_spec,
    }
