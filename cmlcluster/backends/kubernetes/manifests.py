"""Pod and Secret manifests for the Kubernetes backend, as plain dicts (the JSON the API takes).

Pure functions: no kubernetes client, no API calls, nothing read from the environment. The
backend sends what they return; the tests validate it against the API's OpenAPI schemas.

The objects of one session:

- one Secret, ``cmlcluster-<session>``, holding the controller's connection info. When the
  notebook runs in a pod, that pod owns the Secret. (No SSH key: for Horovod the session runs
  horovodrun itself and holds the private key; workers get only the public key, over the control
  plane, for their sshd.)
- one Pod per worker, ``cmlcluster-<session>-<engine>`` (the worker id already starts with the
  session id), owned by the Secret, with the Secret mounted read-only at SESSION_MOUNT_PATH.

So Kubernetes' garbage collector removes every worker when the Secret goes, and the Secret
when the notebook's pod goes: a session that dies leaves nothing running. Secrets reach the
worker as files, never as environment variables: a pod's env is readable by anyone who may
`get pods` in the namespace, and is inherited by every process the user's code starts.

Owner references set ``controller`` only where the owner manages the object (the Secret, for
its workers; the notebook's pod does not manage the Secret) and never ``blockOwnerDeletion``:
where the OwnerReferencesPermissionEnforcement admission plugin is on, setting it needs
`update` on the owner's finalizers, which a notebook's service account rarely has, and it only
matters to foreground deletion. The backend deletes its pods itself at teardown; the garbage
collector is the safety net. (Spark on Kubernetes owns executor pods by its driver the same way.)
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import re
import types
from base64 import b64encode
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...control import CONNECTION_ENV, CONNECTION_FILE_ENV
from ...errors import ConfigError
from ...workers import Resources, WorkerSpec

# Labels (keys in cmlcluster's own prefix, plus the well-known app.kubernetes.io ones).
SESSION_LABEL = "cmlcluster.io/session"
WORKER_LABEL = "cmlcluster.io/worker"
COMPONENT_LABEL = "app.kubernetes.io/component"  # "session" (the Secret) or "worker" (a pod)
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGER = "cmlcluster"
# Where the session runs, on its Secret: `cmlcluster cleanup` on that host ends sessions whose process is gone.
HOST_ANNOTATION = "cmlcluster.io/host"
PID_ANNOTATION = "cmlcluster.io/pid"

# The session Secret, as files in every worker. The agent reads its connection info from the file
# that CONNECTION_FILE_ENV names.
SESSION_MOUNT_PATH = "/var/run/cmlcluster"
SESSION_VOLUME = "cmlcluster-session"
SESSION_FILE_MODE = 0o400  # owner read-only: the file holds the controller's key
CONNECTION_KEY = "connection.json"
CONNECTION_FILE = f"{SESSION_MOUNT_PATH}/{CONNECTION_KEY}"

CONTAINER_NAME = "worker"
SHARED_VOLUME = "cmlcluster-shared"
# A worker's own working folder (an emptyDir) when the session's is not on the shared volume: where
# shipped files land, never the image's folder (often "/").
WORK_VOLUME = "cmlcluster-work"
WORK_PATH = "/var/cmlcluster/work"
GPU_RESOURCE = "nvidia.com/gpu"

# Names cmlcluster sets in every worker; PodOptions.env may not replace them.
RESERVED_ENV = frozenset(
    {"CDSW_MASTER_IP", "CML_MASTER_IP", "CDSW_MASTER_ID", "CDSW_ENGINE_ID", "CDSW_IP_ADDRESS", "PYTHONUNBUFFERED"}
)
RESERVED_ENV_PREFIX = "CMLCLUSTER_"

MAX_NAME = 63  # a DNS-1123 label: a pod's name becomes its hostname, which must be one
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# The classic rule (C identifiers plus '-' and '.'); clusters before 1.34 accept nothing wider.
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


# ---------------------------------------------------------------- names and labels


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def dns_name(*parts: str) -> str:
    """A DNS-1123 label (lowercase alphanumerics and '-', at most 63) from `parts` joined by '-'.

    Parts that are valid already come back joined, unchanged. Otherwise invalid characters
    become '-' and a hash of the original is appended, so that two different inputs never
    share a name (say "A" and "a"), and the result is cut to fit.
    """
    raw = "-".join(parts)
    if len(raw) <= MAX_NAME and _DNS_LABEL.fullmatch(raw):
        return raw
    name = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-")
    suffix = _digest(raw)
    name = name[: MAX_NAME - len(suffix) - 1].rstrip("-")
    return f"{name}-{suffix}" if name else suffix


def label_value(value: str) -> str:
    """`value` as a valid label value (at most 63 of [-A-Za-z0-9_.], alphanumeric at both ends).

    Valid values come back unchanged; others are made valid the way dns_name does, with a hash.
    """
    if len(value) <= MAX_NAME and _LABEL_VALUE.fullmatch(value):
        return value
    cleaned = re.sub(r"[^-A-Za-z0-9_.]", "-", value)
    suffix = _digest(value)
    cleaned = re.sub(r"^[^A-Za-z0-9]+", "", cleaned[: MAX_NAME - len(suffix) - 1])
    cleaned = re.sub(r"[^A-Za-z0-9]+$", "", cleaned)
    return f"{cleaned}-{suffix}" if cleaned else suffix


def secret_name(session_id: str) -> str:
    """The name of the session's Secret: ``cmlcluster-<session>``."""
    return dns_name("cmlcluster", session_id)


def pod_name(worker_id: str) -> str:
    """The name of a worker's pod: ``cmlcluster-<worker id>`` (worker ids are ``<session>-<engine>``)."""
    return dns_name("cmlcluster", worker_id)


def session_labels(session_id: str) -> dict[str, str]:
    """The labels every object of the session carries."""
    return {SESSION_LABEL: label_value(session_id), MANAGED_BY_LABEL: MANAGER}


def session_selector(session_id: str) -> str:
    """A label selector for every object of the session (list, watch and cleanup use it)."""
    return f"{SESSION_LABEL}={label_value(session_id)},{MANAGED_BY_LABEL}={MANAGER}"


# ---------------------------------------------------------------- quantities


def cpu_quantity(cpu: float) -> str:
    """CPUs as a Kubernetes quantity: "2", "500m".

    Kubernetes counts CPU in millicores and rounds a finer amount up, so this does too (docker's
    nano_cpus would keep it). round() first: 4.03 * 1000 is 4030.0000000000005 in floating point.
    """
    if isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not math.isfinite(cpu) or cpu <= 0:
        raise ConfigError(f"cpu={cpu!r}: must be a number greater than 0, e.g. cpu=1")
    millicores = math.ceil(round(cpu * 1000, 6))
    return str(millicores // 1000) if millicores % 1000 == 0 else f"{millicores}m"


def memory_quantity(resources: Resources) -> str:
    """A worker's memory as a Kubernetes quantity: "4Gi", "1536Mi": docker's whole MiB
    (Resources.memory_mib), in "Gi" when they make whole GiB."""
    memory = resources.memory
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory) or memory <= 0:
        raise ConfigError(f"memory={memory!r}: memory (GB) must be a number greater than 0, e.g. memory=1")
    mib = resources.memory_mib
    if mib < 1:
        raise ConfigError(f"memory={memory!r}: less than 1 MiB; memory is in GB, e.g. memory=0.5 for 512 MiB")
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


# ---------------------------------------------------------------- options


def _check_name(what: str, value: object, example: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ConfigError(
            f"{what}={value!r}: not a valid Kubernetes object name (lowercase letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, at most 253); e.g. {what}={example!r}"
        )
    return value


def _check_label_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= MAX_NAME and bool(_LABEL_VALUE.fullmatch(name))


@dataclass(frozen=True)
class SharedVolume:
    """A ReadWriteMany PersistentVolumeClaim mounted on every worker (like the AWS template's EFS).

    claim: the PVC's name, in the workers' namespace; mount_path: where workers see it.
    """

    claim: str
    mount_path: str

    def __post_init__(self) -> None:
        _check_name("shared_volume claim", self.claim, "shared-data")
        path = self.mount_path
        if not isinstance(path, str) or not path.startswith("/") or posixpath.normpath(path) in ("/", "//"):
            raise ConfigError(
                f"shared_volume mount_path={path!r}: must be an absolute folder other than '/', e.g. '/shared'"
            )
        normal = posixpath.normpath(path)
        if _overlaps(normal, SESSION_MOUNT_PATH):
            raise ConfigError(
                f"shared_volume mount_path={path!r}: overlaps {SESSION_MOUNT_PATH}, where cmlcluster mounts the "
                "session's Secret; mount the volume elsewhere, e.g. '/shared'"
            )
        object.__setattr__(self, "mount_path", normal)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _overlaps(a: str, b: str) -> bool:
    return _inside(a, b) or _inside(b, a)


@dataclass(frozen=True)
class PodOptions:
    """What a cluster's admin or user chooses for every worker pod of a session.

    node_selector: node labels the pods must match, e.g. {"nvidia.com/gpu.present": "true"}.
    tolerations: the API's Toleration objects (camelCase keys), e.g.
        [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}].
    service_account: the workers' service account; without one no API token is mounted in
        workers (they run the user's code and need no API access).
    image_pull_secrets: names of docker-registry Secrets in the namespace.
    env: variables for every worker; a launch's own env= wins over them.
    shared_volume: a ReadWriteMany PVC mounted on every worker (SharedVolume).
    """

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    service_account: str | None = None
    image_pull_secrets: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    shared_volume: SharedVolume | None = None

    def __post_init__(self) -> None:
        # Stored as read-only copies: the caller's later changes never reach a frozen options object.
        set_ = object.__setattr__
        set_(self, "node_selector", types.MappingProxyType(self._node_selector()))
        set_(self, "tolerations", tuple(types.MappingProxyType(t) for t in self._tolerations()))
        if self.service_account is not None:
            _check_name("service_account", self.service_account, "cmlcluster-worker")
        set_(self, "image_pull_secrets", self._image_pull_secrets())
        set_(self, "env", types.MappingProxyType(self._env()))
        if self.shared_volume is not None and not isinstance(self.shared_volume, SharedVolume):
            raise ConfigError(
                f"shared_volume={self.shared_volume!r}: give a SharedVolume(claim=..., mount_path=...), "
                "e.g. SharedVolume('shared-data', '/shared')"
            )

    def _node_selector(self) -> dict[str, str]:
        if not isinstance(self.node_selector, Mapping):
            raise ConfigError(
                f"node_selector={self.node_selector!r}: give a dict of node labels, e.g. {{'disktype': 'ssd'}}"
            )
        for key, value in self.node_selector.items():
            if not _check_label_key(key):
                raise ConfigError(
                    f"node_selector key {key!r} is not a valid label key ([prefix/]name, the name at most 63 "
                    "letters, digits, '-', '_' or '.', starting and ending with a letter or digit); "
                    "copy it from `kubectl get nodes --show-labels`"
                )
            if not isinstance(value, str) or len(value) > MAX_NAME or not _LABEL_VALUE.fullmatch(value):
                raise ConfigError(
                    f"node_selector[{key!r}]={value!r} is not a valid label value (a string of at most 63 "
                    "letters, digits, '-', '_' or '.', starting and ending with a letter or digit; "
                    "booleans as 'true'/'false')"
                )
        return dict(self.node_selector)

    def _tolerations(self) -> list[dict[str, Any]]:
        if isinstance(self.tolerations, (str, Mapping)) or not isinstance(self.tolerations, Sequence):
            raise ConfigError(
                f"tolerations={self.tolerations!r}: give a list of tolerations, e.g. "
                "[{'key': 'nvidia.com/gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}]"
            )
        checked = []
        for toleration in self.tolerations:
            if not isinstance(toleration, Mapping):
                raise ConfigError(f"tolerations: {toleration!r} is not a dict like {{'key': ..., 'effect': ...}}")
            unknown = sorted(str(k) for k in set(toleration) - _TOLERATION_KEYS)
            if unknown:
                raise ConfigError(
                    f"tolerations: {toleration!r} has unknown keys {unknown}; a toleration has "
                    f"{sorted(_TOLERATION_KEYS)} (the API's camelCase names)"
                )
            operator = toleration.get("operator", "Equal")
            effect = toleration.get("effect", "")
            key = toleration.get("key", "")
            if operator not in ("Equal", "Exists"):
                raise ConfigError(f"tolerations: operator={operator!r} in {toleration!r}; use 'Equal' or 'Exists'")
            if effect not in _TOLERATION_EFFECTS:
                raise ConfigError(
                    f"tolerations: effect={effect!r} in {toleration!r}; use one of {list(_TOLERATION_EFFECTS)}"
                )
            if not isinstance(key, str) or (key and not _check_label_key(key)):
                raise ConfigError(f"tolerations: key={key!r} in {toleration!r} is not a valid taint key")
            if not key and operator != "Exists":
                raise ConfigError(f"tolerations: {toleration!r} has no key, so its operator must be 'Exists'")
            value = toleration.get("value", "")
            if not isinstance(value, str) or (operator == "Exists" and value):
                raise ConfigError(
                    f"tolerations: value={value!r} in {toleration!r}; a string, and none with operator 'Exists'"
                )
            if "tolerationSeconds" in toleration:
                seconds = toleration["tolerationSeconds"]
                if isinstance(seconds, bool) or not isinstance(seconds, int) or effect != "NoExecute":
                    raise ConfigError(
                        f"tolerations: tolerationSeconds={seconds!r} in {toleration!r}; a whole number of "
                        "seconds, and only with effect 'NoExecute'"
                    )
            checked.append(dict(toleration))
        return checked

    def _image_pull_secrets(self) -> tuple[str, ...]:
        names = self.image_pull_secrets
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ConfigError(
                f"image_pull_secrets={names!r}: give a list of Secret names, e.g. image_pull_secrets=['regcred']"
            )
        return tuple(_check_name("image_pull_secrets item", name, "regcred") for name in names)

    def _env(self) -> dict[str, str]:
        if not isinstance(self.env, Mapping):
            raise ConfigError(f"env={self.env!r}: give a dict of names to strings, e.g. {{'NCCL_DEBUG': 'INFO'}}")
        for name, value in self.env.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
                raise ConfigError(
                    f"env: {name!r} is not a valid variable name (letters, digits, '_', '-' and '.', "
                    "not starting with a digit)"
                )
            if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
                raise ConfigError(f"env: {name!r} is set by cmlcluster in every worker; choose another name")
            if not isinstance(value, str):
                raise ConfigError(f"env[{name!r}]={value!r}: values must be strings; convert with str()")
        return dict(self.env)


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


def worker_labels(session_id: str, worker_id: str) -> dict[str, str]:
    """The labels of a worker's pod."""
    return {**session_labels(session_id), WORKER_LABEL: label_value(worker_id), COMPONENT_LABEL: "worker"}


def worker_resources(spec: WorkerSpec) -> dict[str, dict[str, str]]:
    """Requests equal to limits (the Guaranteed QoS class: the pod gets what it asked for, as in
    CML); GPUs only when asked for: a parameter server's Resources have nvidia_gpu=0."""
    amounts = {"cpu": cpu_quantity(spec.resources.cpu), "memory": memory_quantity(spec.resources)}
    gpus = spec.resources.nvidia_gpu
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ConfigError(f"nvidia_gpu={gpus!r}: must be a whole number of GPUs, 0 or more")
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def worker_env(spec: WorkerSpec, options: PodOptions) -> list[dict[str, str]]:
    """The worker's variables: the options' env, then the spec's (what docker.py passes as is),
    without the connection info, which is a file in the Secret (CONNECTION_FILE_ENV names it)."""
    env = dict(options.env)
    env.update((name, value) for name, value in spec.env.items() if name != CONNECTION_ENV)
    env[CONNECTION_FILE_ENV] = CONNECTION_FILE
    return [{"name": name, "value": value} for name, value in env.items()]


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
    The container's command and env are the spec's, as docker.py sends them, except that the
    controller's connection info is read from the mounted Secret instead of the environment.
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
        "env": worker_env(spec, options),
        "resources": worker_resources(spec),
        "volumeMounts": mounts,
    }
    shared = options.shared_volume
    if shared is not None:
        mounts.append({"name": SHARED_VOLUME, "mountPath": shared.mount_path})
        volumes.append({"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": shared.claim}})
    # The session's folder is the workers' working folder only where they see it: on the shared
    # volume. Elsewhere each worker has a folder of its own, and programs are shipped (Capabilities.sees).
    cwd = posixpath.normpath(spec.cwd)
    if shared is not None and _inside(cwd, shared.mount_path):
        container["workingDir"] = cwd
    else:
        mounts.append({"name": WORK_VOLUME, "mountPath": WORK_PATH})
        volumes.append({"name": WORK_VOLUME, "emptyDir": {}})
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
