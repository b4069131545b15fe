"""What cmlcluster's objects on a cluster are called and labelled, and Kubernetes' rules for names.

Pure functions and constants: the manifests, the options' checks, the backend's watch and
cleanup all find a session's objects by these names and labels.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from ...errors import ConfigError
from ...origin import Origin

# Labels (keys in cmlcluster's own prefix, plus the well-known app.kubernetes.io ones).
SESSION_LABEL = "cmlcluster.io/session"
WORKER_LABEL = "cmlcluster.io/worker"
COMPONENT_LABEL = "app.kubernetes.io/component"  # "session" (the Secret) or "worker" (a pod)
# On the notebook's own pod, its uid: a label no other pod has (replicas of a Deployment share all
# of theirs), that the session's NetworkPolicy admits the notebook by (network_policy). Added by
# the session where this user may patch pods.
POD_UID_LABEL = "cmlcluster.io/pod-uid"
# A StatefulSet's pods carry their own name under this label: unique in the namespace already.
STATEFULSET_POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGER = "cmlcluster"
# Where the session runs, on its Secret: `cmlcluster cleanup` on that host ends sessions that are gone.
# The host and pid, and with them the rest of the session's origin (origin.py), as ORIGIN_PREFIX + field.
ORIGIN_PREFIX = "cmlcluster.io/"
HOST_ANNOTATION = "cmlcluster.io/host"
PID_ANNOTATION = "cmlcluster.io/pid"

CONTAINER_NAME = "worker"  # a worker pod's one container
# Where every worker sees the session's Secret as files (no other volume may be mounted over it).
SESSION_MOUNT_PATH = "/var/run/cmlcluster"

MAX_NAME = 63  # a DNS-1123 label: a pod's name becomes its hostname, which must be one
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


# ---------------------------------------------------------------- Kubernetes' rules


def is_label_value(value: object) -> bool:
    """Whether `value` is a valid label value (at most 63 of [-A-Za-z0-9_.], alphanumeric at both ends)."""
    return isinstance(value, str) and len(value) <= MAX_NAME and bool(_LABEL_VALUE.fullmatch(value))


def is_label_key(key: object) -> bool:
    """Whether `key` is a valid label (or taint) key: [DNS subdomain/]name."""
    if not isinstance(key, str):
        return False
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) > 0 and is_label_value(name)


def check_name(what: str, value: object, example: str) -> str:
    """`value`, if it is a valid object name (a DNS subdomain); else ConfigError naming `what`."""
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ConfigError(
            f"{what}={value!r}: not a valid Kubernetes object name (lowercase letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, at most 253); e.g. {what}={example!r}"
        )
    return value


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
    if is_label_value(value):
        return value
    cleaned = re.sub(r"[^-A-Za-z0-9_.]", "-", value)
    suffix = _digest(value)
    cleaned = re.sub(r"^[^A-Za-z0-9]+", "", cleaned[: MAX_NAME - len(suffix) - 1])
    cleaned = re.sub(r"[^A-Za-z0-9]+$", "", cleaned)
    return f"{cleaned}-{suffix}" if cleaned else suffix


# ---------------------------------------------------------------- cmlcluster's names and labels


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


def worker_labels(session_id: str, worker_id: str) -> dict[str, str]:
    """The labels of a worker's pod."""
    return {**session_labels(session_id), WORKER_LABEL: label_value(worker_id), COMPONENT_LABEL: "worker"}


def origin_annotations(origin: Origin) -> dict[str, str]:
    """The Secret's annotations that say which process its session is (host, boot, pidns, pid, start)."""
    return {ORIGIN_PREFIX + key: value for key, value in origin.as_strings().items()}


def origin_of(annotations: Mapping[str, str]) -> Origin | None:
    """The origin that origin_annotations wrote; None when they cannot tell (an older cmlcluster's)."""
    return Origin.from_strings(
        {key[len(ORIGIN_PREFIX) :]: value for key, value in annotations.items() if key.startswith(ORIGIN_PREFIX)}
    )
