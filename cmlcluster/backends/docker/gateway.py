"""A session network's gateway, shut to the containers of every other network on the engine.

The session's servers on the host listen on its network's gateway, the host's own address on that
network: the controller, and what the frameworks start beside the notebook (an elastic run's
rendezvous store, TensorFlow's coordinator). Docker keeps networks apart in the FORWARD chain, but a
packet from another network's container to this gateway is addressed to the host itself and goes
through INPUT, where Docker adds nothing: any container on the engine reached those servers.

Where this process may change the host's firewall (root, with iptables), one INPUT rule refuses what
reaches the gateway from any other interface but from the host's own addresses; the session's own
containers (through its bridge) and the host's processes still reach it. The rule names its network
in a comment and goes with the network (docker_engine.remove_network), however the session ended:
closed, or reaped after its process died. Elsewhere nothing is added, and docs/security.md says so.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CHAIN = "INPUT"
COMMENT_PREFIX = "cmlcluster-gateway:"  # then the network's name
IPTABLES_TIMEOUT = 10.0


def bridge_name(network_attrs: dict[str, Any]) -> str:
    """The host interface of a bridge network: the name given in its options, else Docker's own
    "br-" and the first 12 characters of the network's id."""
    options = network_attrs.get("Options") or {}
    return str(options.get("com.docker.network.bridge.name") or f"br-{network_attrs['Id'][:12]}")


def rule(network: str, gateway: str, bridge: str) -> list[str]:
    """The INPUT rule (without -I/-D) that refuses packets for `gateway` arriving through any interface
    but `bridge`, unless they come from one of the host's own addresses. Refused, not dropped: a peer
    that tries every address of the host (horovodrun's task services do, to find common interfaces)
    hears at once that this one is closed, where a dropped connection waits out its timeout."""
    return [
        "-d", f"{gateway}/32",
        "!", "-i", bridge,
        "-m", "addrtype", "!", "--src-type", "LOCAL",
        "-m", "comment", "--comment", COMMENT_PREFIX + network,
        "-j", "REJECT",
    ]  # fmt: skip


def rules_of(listing: str, network: str) -> list[list[str]]:
    """The rules of `network` in `iptables -S INPUT`'s output, as arguments that -D takes."""
    found = []
    for line in listing.splitlines():
        words = shlex.split(line)
        if words[:2] == ["-A", CHAIN] and COMMENT_PREFIX + network in words:
            found.append(words[2:])
    return found


def stale_rules(listing: str, bridges: Callable[[str], bool]) -> list[list[str]]:
    """The gateway rules in `iptables -S INPUT`'s output whose bridge is gone (`bridges` says whether an
    interface exists): a network removed while its rule could not be, whose gateway address a new
    network may have now, with its own containers behind another bridge."""
    found = []
    for line in listing.splitlines():
        words = shlex.split(line)
        comment = words[words.index("--comment") + 1] if "--comment" in words[:-1] else ""
        if words[:2] == ["-A", CHAIN] and comment.startswith(COMMENT_PREFIX) and "-i" in words[:-1]:
            if not bridges(words[words.index("-i") + 1]):
                found.append(words[2:])
    return found


def remove_stale() -> int:
    """Remove every gateway rule whose bridge is gone (cleanup); how many."""
    if not can_change_firewall():
        return 0
    try:
        stale = stale_rules(_iptables("-S", CHAIN), lambda name: os.path.exists(f"/sys/class/net/{name}"))
        for words in stale:
            _iptables("-D", CHAIN, *words)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cmlcluster cleanup: could not remove firewall rules of networks that are gone: %s", e)
        return 0
    return len(stale)


def can_change_firewall() -> bool:
    return os.geteuid() == 0 and shutil.which("iptables") is not None


def shut(network: str, gateway: str, bridge: str) -> bool:
    """Add the rule for `network` where this process may; whether it did."""
    if not can_change_firewall():
        log.debug("cmlcluster: not root, or no iptables: %s's gateway stays open to other networks", network)
        return False
    try:
        _iptables("-I", CHAIN, *rule(network, gateway, bridge))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning(
            "cmlcluster: could not shut this session's network gateway %s to other Docker networks (%s); "
            "containers of other networks reach the servers listening there",
            gateway,
            e,
        )
        return False
    return True


def rules(network: str) -> list[list[str]]:
    """The rules of `network` in the firewall now."""
    return rules_of(_iptables("-S", CHAIN), network)


def reopen(network: str) -> None:
    """Remove the rules of `network`, if any (idempotent)."""
    if not can_change_firewall():
        return
    try:
        for words in rules(network):
            _iptables("-D", CHAIN, *words)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cmlcluster: could not remove the firewall rule of network %s: %s", network, e)


def _iptables(*args: str) -> str:
    # -w: wait for the lock that dockerd also takes, rather than fail.
    argv = ["iptables", "-w", str(int(IPTABLES_TIMEOUT)), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IPTABLES_TIMEOUT + 5, check=False)
    if done.returncode != 0:
        raise subprocess.SubprocessError(f"{shlex.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout
