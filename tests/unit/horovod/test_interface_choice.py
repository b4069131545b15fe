"""The hosts' interface for horovodrun, named from what their workers report, so that it never probes them
(its probe's task services get the run's service key on their command lines)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from cmlcluster.backends.ssh.backend import SSHBackend
from cmlcluster.errors import ConfigError
from cmlcluster.horovod.commands import common_interface
from cmlcluster.ssh import sshd


def test_hosts_that_name_their_interface_alike_give_that_name():
    assert common_interface({"10.0.0.2": "ens5", "10.0.0.3": "ens5"}) == "ens5"
    assert common_interface({"10.0.0.2": "eth0"}) == "eth0"


@pytest.mark.parametrize(
    ("reported", "says"),
    [
        ({"10.0.0.2": "ens5", "10.0.0.3": "eth0"}, "10.0.0.2: ens5, 10.0.0.3: eth0"),
        ({"10.0.0.2": "ens5", "10.0.0.3": None}, "10.0.0.3: none holds its address"),
        ({"10.0.0.2": None}, "10.0.0.2: none holds its address"),
    ],
)
def test_hosts_that_differ_are_refused_naming_each_interface_and_the_option(reported, says):
    with pytest.raises(ConfigError, match="interfaces toward the session differ") as e:
        common_interface(reported)
    assert says in str(e.value) and "network_interfaces=" in str(e.value)


def test_no_hosts_is_refused():
    with pytest.raises(ConfigError, match="no hosts"):
        common_interface({})


def _address(family: int, address: str) -> SimpleNamespace:
    return SimpleNamespace(family=family, address=address)


def test_a_worker_reports_the_interface_holding_the_address_the_session_reaches_it_at(monkeypatch):
    import psutil

    interfaces = {
        "lo": [_address(socket.AF_INET, "127.0.0.1")],
        "eth0": [_address(socket.AF_INET, "10.0.0.2"), _address(socket.AF_INET6, "fe80::1%eth0")],
        "ib0": [_address(socket.AF_INET, "192.168.50.2"), _address(socket.AF_INET6, "2001:db8::2")],
    }
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: interfaces)
    assert sshd.interface_of("10.0.0.2") == "eth0"
    assert sshd.interface_of("192.168.50.2") == "ib0"
    assert sshd.interface_of("2001:DB8::2") == "ib0"
    assert sshd.interface_of("10.9.9.9") is None  # translated on the way: no interface of its own holds it
    assert sshd.interface_of("not an address") is None


def test_the_ssh_backend_takes_interface_names_and_gives_them_to_horovodrun():
    backend = SSHBackend(["10.0.0.2"], network_interfaces=["ens5"])
    assert backend.capabilities().interfaces == ("ens5",)
    assert SSHBackend(["10.0.0.2"]).capabilities().interfaces == ()
    for bad in ("ens5", ["ens5;id"], ["-x"], ["e" * 16]):
        with pytest.raises(ConfigError, match="network_interfaces="):
            SSHBackend(["10.0.0.2"], network_interfaces=bad)


def test_the_driver_uses_the_address_the_session_gives_instead_of_its_own_interface_of_that_name(monkeypatch):
    pytest.importorskip("horovod.runner.gloo_run")
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    from cmlcluster.horovod import driver

    for module, name in ((network, "get_driver_ip"), (gloo_run, "launch_gloo"), (gloo_run, "launch_gloo_elastic")):
        monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    monkeypatch.setattr(http_server, "find_port", http_server.find_port)
    driver.bind_rendezvous_to_server_ip(None, "10.200.1.1")
    assert network.get_driver_ip({"ens5"}) == "10.200.1.1"  # this machine has no ens5; the hosts do
