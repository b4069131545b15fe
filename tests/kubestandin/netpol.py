"""NetworkPolicy semantics for the stand-in: which pods a policy selects, and which sources its
ingress rules admit (kubernetes.io/docs/concepts/services-networking/network-policies).

The stand-in answers with these what a network plugin would let through (`connection_allowed`),
and netfilter.py turns the same answers into iptables rules on its pods' bridge.
Pure functions over the objects as the API holds them (dicts).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any


def matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions) selects `labels`; {} selects everything."""
    selector = selector or {}
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _namespace(obj: Mapping[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("namespace") or "default"


def selects(policy: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether `policy` applies to `pod`: same namespace, and its podSelector matches."""
    return _namespace(policy) == _namespace(pod) and matches(policy["spec"].get("podSelector"), _labels(pod))


def _in_block(block: Mapping[str, Any], ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"], strict=False):
        return False
    return not any(address in ipaddress.ip_network(e, strict=False) for e in block.get("except") or [])


def _peer_admits(
    peer: Mapping[str, Any],
    policy_namespace: str,
    namespaces: Mapping[str, Mapping[str, str]],
    pod: Mapping[str, Any] | None,
    ip: str | None,
) -> bool:
    if "ipBlock" in peer:
        return ip is not None and _in_block(peer["ipBlock"], ip)
    if pod is None:  # a source that is no pod of the cluster: only an ipBlock admits it
        return False
    if "namespaceSelector" in peer:
        in_namespace = matches(peer["namespaceSelector"], namespaces.get(_namespace(pod), {}))
    else:  # a podSelector alone: pods of the policy's own namespace
        in_namespace = _namespace(pod) == policy_namespace
    return in_namespace and matches(peer.get("podSelector"), _labels(pod))


def admits(
    policy: Mapping[str, Any],
    namespaces: Mapping[str, Mapping[str, str]],
    *,
    source_pod: Mapping[str, Any] | None = None,
    source_ip: str | None = None,
    port: int | None = None,
    protocol: str = "TCP",
) -> bool:
    """Whether one of `policy`'s ingress rules admits a connection from `source_pod` (a pod, with
    its namespace and labels) or `source_ip`, to `port` (None: any port the rules name).
    namespaces: {name: labels} of the cluster's namespaces, for namespaceSelectors."""
    if source_ip is None and source_pod is not None:
        source_ip = (source_pod.get("status") or {}).get("podIP")
    for rule in policy["spec"].get("ingress") or []:
        peers = rule.get("from")
        if peers and not any(_peer_admits(p, _namespace(policy), namespaces, source_pod, source_ip) for p in peers):
            continue
        ports = rule.get("ports")
        if not ports or port is None:
            return True
        for p in ports:
            if p.get("protocol", "TCP") == protocol and p.get("port") in (None, port):
                return True
            end = p.get("endPort")
            if end is not None and p.get("protocol", "TCP") == protocol and p["port"] <= port <= end:
                return True
    return False


def connection_allowed(
    policies: list[Mapping[str, Any]],
    namespaces: Mapping[str, Mapping[str, str]],
    destination: Mapping[str, Any],
    *,
    source_pod: Mapping[str, Any] | None = None,
    source_ip: str | None = None,
    port: int | None = None,
) -> bool:
    """Whether a connection to pod `destination` is let in: yes when no Ingress policy selects it,
    else when one of those that do admits the source (policies add up; none subtracts)."""
    selecting = [
        p for p in policies if selects(p, destination) and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
    ]
    return not selecting or any(
        admits(p, namespaces, source_pod=source_pod, source_ip=source_ip, port=port) for p in selecting
    )
