"""What a cluster's admin or user chooses for every worker pod, checked when it is given.

PodOptions and SharedVolume are frozen and validated on construction, so that a mistake fails
at use_backend() with the value and the fix, not later in the API's words.
"""

from __future__ import annotations

import posixpath
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import checks, wire
from ...errors import ConfigError
from .names import SESSION_MOUNT_PATH, check_name, is_label_key, is_label_value

# Names cmlcluster sets in every worker, by value in the pod spec (nothing secret); PodOptions.env may not
# replace them.
RESERVED_ENV = frozenset(
    {"CDSW_MASTER_IP", "CML_MASTER_IP", "CDSW_MASTER_ID", "CDSW_ENGINE_ID", "CDSW_IP_ADDRESS", "PYTHONUNBUFFERED"}
) | frozenset(wire.APP_PORT_ENVS)
RESERVED_ENV_PREFIX = "CMLCLUSTER_"
# The classic rule (C identifiers plus '-' and '.'); clusters before 1.34 accept nothing wider.
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
# A storage quantity as the API writes it: a number and a binary or decimal suffix ("10Gi", "500M", "1e9").
_STORAGE_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([eE]\d+|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
# The pods' fsGroup unless told: a group of its own, not root's. (On OpenShift pass fs_group=None:
# its restricted SCC picks one in the namespace's range and refuses any other.)
DEFAULT_FS_GROUP = 1000


@dataclass(frozen=True)
class SharedVolume:
    """A ReadWriteMany PersistentVolumeClaim mounted on every worker (like the AWS template's EFS).

    claim: the PVC's name, in the workers' namespace; mount_path: where workers see it.
    """

    claim: str
    mount_path: str

    def __post_init__(self) -> None:
        check_name("shared_volume claim", self.claim, "shared-data")
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

    def holds(self, path: str) -> bool:
        """Whether the absolute `path` is on this volume, as the workers see it."""
        return _inside(posixpath.normpath(path), self.mount_path)


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

    Pods pass Pod Security "restricted" (non-root, no privilege escalation, every capability
    dropped, the RuntimeDefault seccomp profile); these say as whom they run and what they may use:
    fs_group: the group that owns the pod's volumes (and may read the session's Secret); default
        1000. None: leave it to the cluster (OpenShift's restricted SCC gives one from the
        namespace's range, and refuses one outside it).
    run_as_user: the workers' uid; default None: the image's USER (which must then be a non-root
        number), or the uid the cluster assigns (OpenShift gives a random one).
    work_size: the size limit of each worker's own working folder (an emptyDir), a quantity like
        "10Gi"; a worker that writes more is evicted.
    ephemeral_storage: the local disk each worker asks the scheduler for (its working folder, logs
        and writable layer), a quantity; default the same as work_size.
    network_policy: a NetworkPolicy per session that admits to its pods only the session's own
        pods and the notebook (default True); False where the cluster has no network plugin that
        enforces them, or the namespace's own policies already decide.
    allow_from: who else may connect to the workers, as NetworkPolicyPeer dicts (camelCase, e.g.
        [{"ipBlock": {"cidr": "192.0.2.0/24"}}] for a laptop reaching them through a VPN); the
        notebook's own address (the backend's controller_ip) is always admitted.
    """

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    service_account: str | None = None
    image_pull_secrets: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    shared_volume: SharedVolume | None = None
    fs_group: int | None = DEFAULT_FS_GROUP
    run_as_user: int | None = None
    work_size: str = "10Gi"
    ephemeral_storage: str | None = None
    network_policy: bool = True
    allow_from: Sequence[Mapping[str, Any]] = ()

    def __post_init__(self) -> None:
        # Stored as read-only copies: the caller's later changes never reach a frozen options object.
        set_ = object.__setattr__
        set_(self, "node_selector", types.MappingProxyType(self._node_selector()))
        set_(self, "tolerations", tuple(types.MappingProxyType(t) for t in self._tolerations()))
        if self.service_account is not None:
            check_name("service_account", self.service_account, "cmlcluster-worker")
        set_(self, "image_pull_secrets", self._image_pull_secrets())
        set_(self, "env", types.MappingProxyType(self._env()))
        if self.shared_volume is not None and not isinstance(self.shared_volume, SharedVolume):
            raise ConfigError(
                f"shared_volume={self.shared_volume!r}: give a SharedVolume(claim=..., mount_path=...), "
                "e.g. SharedVolume('shared-data', '/shared')"
            )
        for what, value in (("fs_group", self.fs_group), ("run_as_user", self.run_as_user)):
            # Not 0: root's group or user is what Pod Security "restricted" keeps out.
            if value is not None and not checks.whole(value, 1, 2**31 - 1):
                raise ConfigError(
                    f"{what}={value!r}: give a non-root id (a whole number from 1 to 2147483647), or None to "
                    "leave it to the cluster"
                )
        set_(self, "work_size", _storage("work_size", self.work_size))
        if self.ephemeral_storage is not None:
            set_(self, "ephemeral_storage", _storage("ephemeral_storage", self.ephemeral_storage))
        if not isinstance(self.network_policy, bool):
            raise ConfigError(f"network_policy={self.network_policy!r}: give True or False")
        set_(self, "allow_from", tuple(types.MappingProxyType(p) for p in self._allow_from()))

    def _node_selector(self) -> dict[str, str]:
        if not isinstance(self.node_selector, Mapping):
            raise ConfigError(
                f"node_selector={self.node_selector!r}: give a dict of node labels, e.g. {{'disktype': 'ssd'}}"
            )
        for key, value in self.node_selector.items():
            if not is_label_key(key):
                raise ConfigError(
                    f"node_selector key {key!r} is not a valid label key ([prefix/]name, the name at most 63 "
                    "letters, digits, '-', '_' or '.', starting and ending with a letter or digit); "
                    "copy it from `kubectl get nodes --show-labels`"
                )
            if not is_label_value(value):
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
            if not isinstance(key, str) or (key and not is_label_key(key)):
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
                if not checks.whole(seconds) or effect != "NoExecute":
                    raise ConfigError(
                        f"tolerations: tolerationSeconds={seconds!r} in {toleration!r}; a whole number of "
                        "seconds, and only with effect 'NoExecute'"
                    )
            checked.append(dict(toleration))
        return checked

    def _allow_from(self) -> list[dict[str, Any]]:
        peers = self.allow_from
        if isinstance(peers, (str, Mapping)) or not isinstance(peers, Sequence):
            raise ConfigError(
                f"allow_from={peers!r}: give a list of NetworkPolicy peers, e.g. "
                "[{'ipBlock': {'cidr': '192.0.2.0/24'}}]"
            )
        checked = []
        for peer in peers:
            if not isinstance(peer, Mapping) or not peer or set(peer) - _PEER_KEYS:
                raise ConfigError(
                    f"allow_from: {peer!r} is not a NetworkPolicy peer: a dict with some of {sorted(_PEER_KEYS)}, "
                    "e.g. {'namespaceSelector': {'matchLabels': {'kubernetes.io/metadata.name': 'jupyter'}}}"
                )
            if "ipBlock" in peer and (len(peer) > 1 or not isinstance(peer["ipBlock"], Mapping)):
                raise ConfigError(f"allow_from: {peer!r}: an ipBlock stands alone, as {{'ipBlock': {{'cidr': ...}}}}")
            checked.append(dict(peer))
        return checked

    def _image_pull_secrets(self) -> tuple[str, ...]:
        names = self.image_pull_secrets
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ConfigError(
                f"image_pull_secrets={names!r}: give a list of Secret names, e.g. image_pull_secrets=['regcred']"
            )
        return tuple(check_name("image_pull_secrets item", name, "regcred") for name in names)

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


def _storage(what: str, value: object) -> str:
    """A storage quantity ("10Gi") greater than 0, checked; a whole number of bytes is taken too."""
    if checks.whole(value, 1):
        return str(value)
    match = _STORAGE_QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None or not float(match[1]):
        raise ConfigError(f"{what}={value!r}: give a storage quantity greater than 0, e.g. {what}='10Gi'")
    return str(value)
