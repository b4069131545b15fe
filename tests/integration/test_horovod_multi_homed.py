"""Horovod on multi-homed SSH hosts: the ranks talk over a second network, not the one the session
reaches the hosts on, as on machines with an InfiniBand or a second Ethernet NIC.

Two SSH test hosts (containers on their own network, which the -H names are addresses of) are each
given a second network; its interface is named alike on the hosts and on this machine (the bridge's
name), and horovodrun is told to use it (--network-interfaces, from the backend's interfaces): the
rendezvous binds this machine's address there (horovod's get_driver_ip) and each rank dials it from
its host's address on that network, which no -H name resolves to. The rendezvous admits it because
each worker reported all of its addresses (cmlcluster.ssh.sshd:start). Before, it closed those
connections unread, and the ranks' Gloo gave up on it ("HTTP request failed"): both runs failed."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from harness.fixtures import ssh_backend
from harness.horovod_scripts import ALLREDUCE, ELASTIC_ALLREDUCE

from cmlcluster.horovod import run_horovod

pytestmark = pytest.mark.integration


@dataclass
class SecondNetwork:
    nic: str  # its interface's name, on this machine (the bridge) and on each host
    gateway: str  # this machine's address on it: the rendezvous binds it
    addresses: dict[str, str]  # host's first address (its -H name) -> its address on this network


@pytest.fixture
def two_nic_hosts() -> Iterator[tuple[Any, SecondNetwork]]:
    pytest.importorskip("horovod.tensorflow")
    if os.getuid() != 0 or not shutil.which("nsenter"):
        pytest.skip("needs root and nsenter to rename an interface in a host's network namespace")
    from harness.sshhosts import NETWORK_LABEL, start_hosts

    nic = f"hvd{secrets.token_hex(4)}"  # an interface name: 15 characters at most
    with start_hosts(2) as hosts:
        client = hosts._client
        network = client.networks.create(
            f"cmlcluster-hosts-{nic}",
            driver="bridge",
            options={"com.docker.network.bridge.name": nic},
            labels={NETWORK_LABEL: "1"},
        )
        try:
            network.reload()
            gateway = next(c["Gateway"] for c in network.attrs["IPAM"]["Config"] if ":" not in c.get("Gateway", ":"))
            addresses = {}
            for host in hosts.hosts:
                network.connect(host.container_id)
                container = host._container
                container.reload()
                address = container.attrs["NetworkSettings"]["Networks"][network.name]["IPAddress"]
                addresses[host.ip] = address
                # The host's interface there gets this machine's name for it, renamed from this machine in
                # the host's network namespace (sshd and the workers there have no CAP_NET_ADMIN).
                pid = container.attrs["State"]["Pid"]
                if not os.path.exists(f"/proc/{pid}/ns/net"):
                    pytest.skip("the Docker engine's containers are not this machine's processes (a remote engine)")
                namespace = ["nsenter", "-t", str(pid), "-n", "ip"]
                shown = subprocess.run([*namespace, "-o", "-4", "addr", "show"], capture_output=True, text=True)
                [device] = [line.split()[1] for line in shown.stdout.splitlines() if f" {address}/" in line]
                for change in (["down"], ["name", nic], ["up"]):
                    subprocess.run([*namespace, "link", "set", "dev", device, *change], check=True)
                    device = nic if change[0] == "name" else device
            yield hosts, SecondNetwork(nic, gateway, addresses)
        finally:
            hosts.close()  # the containers first: a network with endpoints cannot be removed
            network.remove()


def backend_on(hosts: Any, nic: str) -> Any:
    """The SSH backend for `hosts`, its workers talking over `nic` (as a backend with fixed interfaces says)."""
    backend = ssh_backend(hosts, slots=1)
    capabilities = backend.capabilities()
    backend.capabilities = lambda: dataclasses.replace(capabilities, interfaces=(nic,))
    return backend


def check_ranks(result: Any, second: SecondNetwork) -> None:
    assert result.ok, f"{result.message}\n" + "\n".join(result.driver_output[-30:])
    assert sorted(result.output) == [0, 1]
    text = "\n".join(line for lines in result.output.values() for line in lines)
    assert text.count("of 2 sum 3 ") == 2, text  # both ranks, the allreduce over the second network
    assert f"rendezvous {second.gateway}" in text  # the ranks dialed this machine there
    assert "refused a connection" not in "\n".join(result.driver_output)
    # Where the ranks dialed from: their hosts' addresses there, which are no -H name.
    assert not set(second.addresses.values()) & {host for host, _ in result.hosts}


def test_a_static_run_whose_ranks_dial_the_rendezvous_from_a_second_nic_passes(two_nic_hosts, tmp_path):
    hosts, second = two_nic_hosts
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    result = run_horovod(str(script), np=2, workers=2, backend=backend_on(hosts, second.nic), start_timeout=40)
    check_ranks(result, second)
    assert f"iface {second.nic}" in "\n".join(result.output[0])


@pytest.mark.matrix  # the rendezvous admits a second NIC's address the same way for both: the static run above
def test_an_elastic_run_whose_ranks_dial_the_rendezvous_from_a_second_nic_passes(two_nic_hosts, tmp_path):
    hosts, second = two_nic_hosts
    script = tmp_path / "elastic_allreduce.py"
    script.write_text(ELASTIC_ALLREDUCE)
    backend = backend_on(hosts, second.nic)
    result = run_horovod(str(script), np=2, workers=2, max_restarts=1, backend=backend, start_timeout=40)
    check_ranks(result, second)
