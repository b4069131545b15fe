"""NetworkPolicy enforcement for the stand-in: iptables rules on the host for its pods' bridge, as a
network plugin (Calico, kube-router) enforces policies with netfilter on a node.

A chain of the cluster's own, jumped to from Docker's DOCKER-USER chain for traffic between two
containers on the cluster's bridge, is rewritten whole (iptables-restore, atomically) whenever a pod or a
NetworkPolicy changes: replies to established connections pass; a pod that an Ingress policy selects
accepts only the pods and ipBlocks the policies admit (netpol.py decides), and drops the rest. Ports in
rules are not looked at (a rule's peers are admitted on every port). Traffic from the host itself (the
notebook, on the network's gateway) does not cross the bridge's FORWARD path and is never dropped.
Needs root, iptables and br_netfilter (bridge-nf-call-iptables=1), as Docker's own isolation does; where
they are missing, `available()` says why and nothing is enforced.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import Any

from .netpol import connection_allowed, selects

BRIDGE_NETFILTER = "/proc/sys/net/bridge/bridge-nf-call-iptables"
# The chain of one cluster: "KST-<pid>-<cluster id>", the pid of the process that made it, so that a
# later cluster removes the chains of processes that died without closing theirs.
_CHAIN = re.compile(r"KST-(\d+)-[0-9a-f]+")


def available() -> str:
    """ "" when policies can be enforced here, else why not."""
    if shutil.which("iptables") is None or shutil.which("iptables-restore") is None:
        return "no iptables"
    try:
        with open(BRIDGE_NETFILTER) as f:
            if f.read().strip() != "1":
                return "bridge-nf-call-iptables is off: traffic between containers skips iptables"
    except OSError:
        return "br_netfilter is not loaded"
    return ""


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True, timeout=30, check=False)


def rules(
    chain: str,
    pods: list[Mapping[str, Any]],
    policies: list[Mapping[str, Any]],
    namespaces: Mapping[str, Mapping[str, str]],
) -> list[str]:
    """The chain's rules (iptables-restore lines) for `pods` (those with an IP) under `policies`."""
    lines = [f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]
    placed = [p for p in pods if (p.get("status") or {}).get("podIP")]
    for destination in placed:
        selecting = [
            p
            for p in policies
            if selects(p, destination) and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        ]
        if not selecting:
            continue
        to = destination["status"]["podIP"]
        for source in placed:
            if source is not destination and connection_allowed(policies, namespaces, destination, source_pod=source):
                lines.append(f"-A {chain} -s {source['status']['podIP']}/32 -d {to}/32 -j RETURN")
        for policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                for peer in rule.get("from") or []:
                    block = peer.get("ipBlock")
                    if block and ":" not in block["cidr"]:
                        for excluded in block.get("except") or []:
                            lines.append(f"-A {chain} -s {excluded} -d {to}/32 -j DROP")
                        lines.append(f"-A {chain} -s {block['cidr']} -d {to}/32 -j RETURN")
        lines.append(f"-A {chain} -d {to}/32 -j DROP")
    return lines


class Enforcer:
    """Keeps the cluster's chain in step with its pods and policies, on a thread of its own: `changed()`
    asks for a rewrite; `applied` counts rewrites done (tests wait on it)."""

    def __init__(self, cluster_id: str, bridge: str, state: Callable[[], tuple[list, list, dict]]):
        self.chain = f"KST-{os.getpid()}-{cluster_id[:8]}"  # chain names are at most 28 characters
        self.bridge, self.state = bridge, state
        self.applied = 0
        self.error = ""
        self._wake = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kubestandin-netfilter-{cluster_id}", daemon=True)

    def start(self) -> None:
        _iptables("-N", self.chain)
        jump = ("-i", self.bridge, "-o", self.bridge, "-j", self.chain)
        if _iptables("-C", "DOCKER-USER", *jump).returncode != 0:
            made = _iptables("-I", "DOCKER-USER", *jump)
            if made.returncode != 0:
                raise RuntimeError(f"iptables: could not jump to {self.chain}: {made.stderr.strip()}")
        self._apply()
        self._thread.start()

    def changed(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            if self._done.is_set():
                return
            self._wake.clear()
            try:
                self._apply()
            except Exception as e:  # said by `error`, not lost in a thread
                self.error = repr(e)

    def _apply(self) -> None:
        pods, policies, namespaces = self.state()
        text = "\n".join(
            ["*filter", f":{self.chain} - [0:0]", *rules(self.chain, pods, policies, namespaces), "COMMIT", ""]
        )
        done = subprocess.run(
            ["iptables-restore", "-w", "10", "--noflush"],
            input=text,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"iptables-restore: {done.stderr.strip()}")
        self.applied += 1

    def close(self) -> None:
        self._done.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(30)
        _remove_chain(self.chain)


def _remove_chain(chain: str) -> None:
    """A chain and the DOCKER-USER rules that jump to it."""
    with contextlib.suppress(Exception):
        for line in _iptables("-S", "DOCKER-USER").stdout.splitlines():
            if line.startswith("-A DOCKER-USER ") and line.endswith(f"-j {chain}"):
                _iptables("-D", *line.split()[1:])
        _iptables("-F", chain)
        _iptables("-X", chain)


def remove_dead(alive: Callable[[int], bool]) -> None:
    """Remove the chains of stand-ins whose process is gone (`alive(pid)` says)."""
    if available():
        return
    listed = _iptables("-S").stdout.split()
    for chain in {word for word in listed if _CHAIN.fullmatch(word)}:
        match = _CHAIN.fullmatch(chain)
        if match and not alive(int(match[1])):
            _remove_chain(chain)
