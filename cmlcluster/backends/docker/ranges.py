"""An address range for a session's Docker network, chosen as the engine's own allocator chooses.

A session's network is made with its range given (docker_engine.session_network): Docker starts a
container at an address of one's choosing (a lost TensorFlow task's replacement, at the lost task's)
only on a network whose range was given when it was made. Letting the engine pick the range and then
making the network again with it cost a bridge's removal (0.2 s of every Docker session's start);
this module picks it instead: the first range of the engine's address pools that overlaps no Docker
network and no route of the host, which is what Docker checks for the ranges it picks itself.

The host's routes are this machine's, so the pick is made only when the engine runs on this machine,
in its network namespace (engine_is_here); elsewhere (a remote engine, Docker Desktop's VM, rootless
Docker) the engine picks.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

Range = ipaddress.IPv4Network

# Docker's own default-address-pools (libnetwork's ipamutils, 20.10 to 27), when the engine names none.
DOCKER_DEFAULT_POOLS: tuple[tuple[str, int], ...] = (
    ("172.17.0.0/16", 16),
    ("172.18.0.0/16", 16),
    ("172.19.0.0/16", 16),
    ("172.20.0.0/14", 16),
    ("172.24.0.0/14", 16),
    ("172.28.0.0/14", 16),
    ("192.168.0.0/16", 20),
)


def engine_is_here(info: Mapping[str, Any]) -> bool:
    """Whether the engine of `docker info` runs on this machine, in its network namespace."""
    rootless = any("rootless" in str(option) for option in info.get("SecurityOptions") or ())
    return info.get("Name") == socket.gethostname() and not rootless


def pools(info: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The engine's address pools, in its order: (base, size of each range)."""
    configured = info.get("DefaultAddressPools") or ()
    return [(p["Base"], int(p["Size"])) for p in configured] or list(DOCKER_DEFAULT_POOLS)


def network_ranges(networks: Iterable[Any]) -> list[Range]:
    """The IPv4 ranges of Docker networks (the SDK's Network objects, as networks.list() gives them)."""
    ranges = []
    for network in networks:
        for config in (network.attrs.get("IPAM") or {}).get("Config") or ():
            subnet = config.get("Subnet", "")
            if subnet and ":" not in subnet:
                ranges.append(ipaddress.IPv4Network(subnet, strict=False))
    return ranges


def host_routes(table: str = "/proc/net/route") -> list[Range]:
    """The IPv4 destinations of this machine's routes, but its default route (Linux's route table)."""
    try:
        with open(table) as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return []
    routes = []
    for row in rows:
        fields = row.split()
        if len(fields) < 8:
            continue
        # Little-endian hex, as the kernel writes them.
        destination = socket.inet_ntoa(struct.pack("<I", int(fields[1], 16)))
        mask = socket.inet_ntoa(struct.pack("<I", int(fields[7], 16)))
        route = ipaddress.IPv4Network(f"{destination}/{mask}", strict=False)
        if route.prefixlen:
            routes.append(route)
    return routes


def candidates(pool_list: Sequence[tuple[str, int]]) -> Iterator[Range]:
    for base, size in pool_list:
        yield from ipaddress.IPv4Network(base, strict=False).subnets(new_prefix=size)


def free_range(pool_list: Sequence[tuple[str, int]], taken: Sequence[Range]) -> Range | None:
    """The first range of the pools that overlaps none of `taken`; None when every one does."""
    for candidate in candidates(pool_list):
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    return None
