"""Pod Security admission for the stand-in: the checks of the "baseline" and "restricted" levels of
the Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards), with the
words Kubernetes' admission plugin (k8s.io/pod-security-admission) refuses a pod in:

    pods "x" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false
    (container "worker" must set securityContext.allowPrivilegeEscalation=false), ...

A namespace labelled pod-security.kubernetes.io/enforce=restricted refuses such a pod with 403.
Pure functions over the pod as sent (a dict); what the stand-in leaves out (AppArmor, SELinux,
/proc mount types, sysctls, Windows) it says nothing about.
"""

from __future__ import annotations

from typing import Any

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")
# Baseline: what a container may add without being "non-default".
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# Restricted: the volume types a pod may use (no hostPath, NFS, iSCSI, ...).
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
_NOT_VOLUME_SOURCES = frozenset({"name"})
_SECCOMP_OK = ("RuntimeDefault", "Localhost")


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    kinds = ("initContainers", "containers", "ephemeralContainers")
    return [c for kind in kinds for c in spec.get(kind) or []]


def _adds(container: dict[str, Any], capabilities: list[str]) -> str:
    quoted = _quoted(capabilities)
    return f'container "{container.get("name", "")}" must not include {quoted} in securityContext.capabilities.add'


def _quoted(words: list[str]) -> str:
    return ", ".join(f'"{word}"' for word in words)


def _names(containers: list[dict[str, Any]], what: str = "container") -> str:
    """'container "a"' or 'containers "a", "b"', as the admission plugin names them."""
    quoted = _quoted([c.get("name", "") for c in containers])
    return f"{what} {quoted}" if len(containers) == 1 else f"{what}s {quoted}"


def _baseline(spec: dict[str, Any]) -> list[str]:
    found = []
    host = [f"{key}=true" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    if host:
        found.append(f"host namespaces ({', '.join(host)})")
    containers = _containers(spec)
    privileged = [c for c in containers if (c.get("securityContext") or {}).get("privileged")]
    if privileged:
        found.append(f"privileged ({_names(privileged)} must not set securityContext.privileged=true)")
    added = []
    for c in containers:
        extra = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        bad = [cap for cap in extra if cap not in BASELINE_CAPABILITIES]
        if bad:
            added.append(_adds(c, bad))
    if added:
        found.append(f"non-default capabilities ({'; '.join(added)})")
    host_path = [v for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_path:
        found.append(f"hostPath volumes ({_names(host_path, 'volume')})")
    ports = [
        f'container "{c.get("name", "")}" uses hostPort {p["hostPort"]}'
        for c in containers
        for p in c.get("ports") or []
        if p.get("hostPort")
    ]
    if ports:
        found.append(f"hostPort ({', '.join(ports)})")
    return found


def _restricted(spec: dict[str, Any]) -> list[str]:
    found = []
    pod_context = spec.get("securityContext") or {}
    containers = _containers(spec)
    contexts = [(c, c.get("securityContext") or {}) for c in containers]

    odd = [
        f'volume "{v.get("name", "")}" uses restricted volume type "{kind}"'
        for v in spec.get("volumes") or []
        for kind in v
        if kind not in _NOT_VOLUME_SOURCES and kind not in RESTRICTED_VOLUMES
    ]
    if odd:
        found.append(f"restricted volume types ({', '.join(odd)})")

    escalating = [c for c, ctx in contexts if ctx.get("allowPrivilegeEscalation") is not False]
    if escalating:
        found.append(
            f"allowPrivilegeEscalation != false ({_names(escalating)} must set "
            "securityContext.allowPrivilegeEscalation=false)"
        )

    capabilities = []
    not_dropping = [c for c, ctx in contexts if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or [])]
    if not_dropping:
        capabilities.append(f'{_names(not_dropping)} must set securityContext.capabilities.drop=["ALL"]')
    for c, ctx in contexts:
        adding = [cap for cap in (ctx.get("capabilities") or {}).get("add") or [] if cap != "NET_BIND_SERVICE"]
        if adding:
            capabilities.append(_adds(c, adding))
    if capabilities:
        found.append(f"unrestricted capabilities ({'; '.join(capabilities)})")

    # runAsNonRoot: true on the pod, unless a container says false; or on every container.
    pod_non_root = pod_context.get("runAsNonRoot")
    explicit_root = [c for c, ctx in contexts if ctx.get("runAsNonRoot") is False]
    unset = [c for c, ctx in contexts if ctx.get("runAsNonRoot") is None and pod_non_root is not True]
    if pod_non_root is False or explicit_root or unset:
        if pod_non_root is False:
            why = "pod must not set securityContext.runAsNonRoot=false"
        elif explicit_root:
            why = f"{_names(explicit_root)} must not set securityContext.runAsNonRoot=false"
        else:
            why = f"pod or {_names(unset)} must set securityContext.runAsNonRoot=true"
        found.append(f"runAsNonRoot != true ({why})")

    root_user = pod_context.get("runAsUser") == 0 or any(ctx.get("runAsUser") == 0 for _, ctx in contexts)
    if root_user:
        found.append("runAsUser=0 (pod or a container must not set runAsUser=0)")

    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    explicit = [(c, ctx["seccompProfile"].get("type")) for c, ctx in contexts if ctx.get("seccompProfile")]
    wrong = [(f'container "{c.get("name", "")}"', kind) for c, kind in explicit if kind not in _SECCOMP_OK]
    if pod_seccomp is not None and pod_seccomp not in _SECCOMP_OK:
        wrong.insert(0, ("pod", pod_seccomp))
    unset = [c for c, ctx in contexts if not ctx.get("seccompProfile") and pod_seccomp is None]
    if wrong:
        who, kinds = " and ".join(w for w, _ in wrong), sorted({str(kind) for _, kind in wrong})
        found.append(f"seccompProfile ({who} must not set securityContext.seccompProfile.type to {_quoted(kinds)})")
    elif unset:
        found.append(
            f"seccompProfile (pod or {_names(unset)} must set securityContext.seccompProfile.type to "
            '"RuntimeDefault" or "Localhost")'
        )
    return found


def violations(pod: dict[str, Any], level: str = "restricted") -> list[str]:
    """What `pod` breaks at `level` ("privileged": nothing), each "rule (details)", in Kubernetes' order
    of checks: baseline first, then restricted."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r}: one of {LEVELS}")
    spec = pod.get("spec") or {}
    if level == "privileged":
        return []
    found = _baseline(spec)
    if level == "restricted":
        found += _restricted(spec)
    return found


def refusal(pod: dict[str, Any], level: str) -> str | None:
    """The message a namespace enforcing `level` refuses `pod` with, or None when it admits it."""
    found = violations(pod, level)
    if not found:
        return None
    name = (pod.get("metadata") or {}).get("name", "")
    return f'pods "{name}" is forbidden: violates PodSecurity "{level}:latest": {", ".join(found)}'
