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

from ... import checks
from ...errors import ConfigError
from .names import SESSION_MOUNT_PATH, check_name, is_label_key, is_label_value

# Names cmlcluster sets in every worker; PodOptions.env may not replace them.
RESERVED_ENV = frozenset(
    {"CDSW_MASTER_IP", "CML_MASTER_IP", "CDSW_MASTER_ID", "CDSW_ENGINE_ID", "CDSW_IP_ADDRESS", "PYTHONUNBUFFERED"}
)
RESERVED_ENV_PREFIX = "CMLCLUSTER_"
# The classic rule (C identifiers plus '-' and '.'); clusters before 1.34 accept nothing wider.
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


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
            check_name("service_account", self.service_account, "cmlcluster-worker")
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
