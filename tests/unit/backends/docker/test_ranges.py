"""The range a session's Docker network is made with (backends/docker_ranges.py): the engine's pools in
its order, past its networks' ranges and this machine's routes, and only for an engine on this machine.
That the engine takes it, and two sessions at once get two ranges: test_docker_privileges.py."""

from __future__ import annotations

import ipaddress
import socket

from cmlcluster.backends.docker import ranges


def net(text: str) -> ipaddress.IPv4Network:
    return ipaddress.ip_network(text)


def test_the_first_range_of_the_pools_past_what_is_taken():
    pools = [("10.200.0.0/16", 24)]
    assert ranges.free_range(pools, []) == net("10.200.0.0/24")
    taken = [net("10.200.0.0/24"), net("10.200.1.0/24"), net("10.200.2.0/23")]
    assert ranges.free_range(pools, taken) == net("10.200.4.0/24")


def test_a_route_over_a_range_skips_every_range_it_covers():
    pools = [("172.17.0.0/16", 16), ("172.20.0.0/14", 16)]
    assert ranges.free_range(pools, [net("172.16.0.0/12")]) is None
    assert ranges.free_range(pools, [net("172.17.5.0/24"), net("172.20.0.0/15")]) == net("172.22.0.0/16")


def test_the_engine_s_own_pools_when_it_names_none():
    assert ranges.pools({}) == list(ranges.DOCKER_DEFAULT_POOLS)
    assert ranges.pools({"DefaultAddressPools": [{"Base": "10.200.0.0/16", "Size": 24}]}) == [("10.200.0.0/16", 24)]


def test_this_machine_s_routes_are_read_from_the_kernel_s_table_without_the_default_route(tmp_path):
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "docker0\t0000C80A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
        "tun0\t000010AC\t00000000\t0001\t0\t0\t0\t0000F0FF\t0\t0\t0\n"
    )
    assert ranges.host_routes(str(table)) == [net("10.200.0.0/24"), net("172.16.0.0/12")]
    assert ranges.host_routes(str(tmp_path / "absent")) == []


def test_the_ranges_of_networks_are_their_ipv4_subnets():
    class Network:
        def __init__(self, *subnets: str) -> None:
            self.attrs = {"IPAM": {"Config": [{"Subnet": s} for s in subnets]}}

    found = ranges.network_ranges([Network("10.200.3.0/24", "fd00::/64"), Network(), Network("172.18.0.0/16")])
    assert found == [net("10.200.3.0/24"), net("172.18.0.0/16")]


def test_only_an_engine_on_this_machine_and_in_its_network_namespace_is_picked_for():
    here = socket.gethostname()
    assert ranges.engine_is_here({"Name": here, "SecurityOptions": ["name=seccomp,profile=default"]})
    assert not ranges.engine_is_here({"Name": here, "SecurityOptions": ["name=seccomp", "name=rootless"]})
    assert not ranges.engine_is_here({"Name": "docker-desktop"})
    assert not ranges.engine_is_here({})
