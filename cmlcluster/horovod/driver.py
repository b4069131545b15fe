"""horovodrun, with its rendezvous listening on the one address the ranks dial:

    python -m cmlcluster.horovod.driver [horovodrun's arguments...]

The same as ``horovodrun [arguments]`` (horovod.runner.launch's own run_commandline), except that
the Gloo rendezvous, an HTTP server without authentication, binds the address horovodrun gives the
ranks (HOROVOD_GLOO_RENDEZVOUS_ADDR: 127.0.0.1 when every rank runs on this machine) instead of
every interface. Horovod has no option for it, so this wraps some of its private names, probed
before the run: an upgrade that renamed one fails with their names, not with a rendezvous open to
the network. Where the session names the hosts' interface itself (the `ssh` backend: so that
horovodrun never probes them with task services whose command lines hold its service key), it
also gives that address (CMLCLUSTER_HOROVOD_DRIVER_ADDRESS), which then replaces horovod's
get_driver_ip. An elastic run (launch_gloo_elastic) starts its rendezvous before it picks the address:
that address is worked out first here, the way horovod then does (the first of the interfaces
horovodrun was given, or found on the hosts discovered at start).

The rendezvous also admits connections only from the job's hosts and, from this machine, from
processes of the session's user; in an elastic run, where it unpickles what ranks register, it
takes that only signed with the run's key, read from the 0600 file CMLCLUSTER_RENDEZVOUS_KEY_FILE
names (cmlcluster.horovod.rendezvous). The job's hosts are the names horovodrun is given (-H, or
its discovery script's list each time it runs it), by the addresses each resolves to and those its
worker reported of its own interfaces, read from the file CMLCLUSTER_RENDEZVOUS_HOSTS_FILE names
(again each time: the session rewrites it as hosts come and go). Both variables are taken out of
the environment before horovodrun copies it onto the ranks' command lines.
"""

from __future__ import annotations

import inspect
import ipaddress
import os
import socketserver
import sys
from collections.abc import Callable
from typing import Any

from .. import probes
from . import commands, rendezvous

ELASTIC_ARGUMENTS = ("settings", "get_common_interfaces", "rendezvous")


def _checks() -> list[probes.Check]:
    from horovod.runner import gloo_run
    from horovod.runner.common.util import settings
    from horovod.runner.driver import driver_service
    from horovod.runner.elastic import discovery
    from horovod.runner.elastic import rendezvous as elastic_rendezvous
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    handler = http_server.RendezvousHandler
    return [
        (
            "horovod.runner.http.http_server.RendezvousHTTPServer, a socketserver (verify_request)",
            lambda: issubclass(http_server.RendezvousHTTPServer, socketserver.BaseServer),
        ),
        (
            "horovod.runner.http.http_server.RendezvousHandler.do_PUT/do_GET/do_DELETE/_put_value/send_status_code",
            lambda: all(
                callable(getattr(handler, n, None))
                for n in ("do_PUT", "do_GET", "do_DELETE", "_put_value", "send_status_code")
            ),
        ),
        (
            f"horovod.runner.elastic.rendezvous.PUT_WORKER_ADDRESSES == {rendezvous.SIGNED_SCOPE!r}",
            lambda: elastic_rendezvous.PUT_WORKER_ADDRESSES == rendezvous.SIGNED_SCOPE,
        ),
        (
            "horovod.runner.elastic.discovery.HostDiscovery.find_available_hosts_and_slots",
            lambda: callable(discovery.HostDiscovery.find_available_hosts_and_slots),
        ),
        (
            "horovod.runner.common.util.settings.Settings(hosts)",
            lambda: "hosts" in inspect.signature(settings.Settings).parameters,
        ),
        ("horovod.runner.http.http_server.find_port", lambda: callable(http_server.find_port)),
        (
            "horovod.runner.gloo_run.launch_gloo(..., server_ip)",
            lambda: "server_ip" in inspect.signature(gloo_run.launch_gloo).parameters,
        ),
        (
            f"horovod.runner.gloo_run.launch_gloo_elastic({', '.join(ELASTIC_ARGUMENTS)})",
            lambda: set(ELASTIC_ARGUMENTS) <= set(inspect.signature(gloo_run.launch_gloo_elastic).parameters),
        ),
        ("horovod.runner.util.network.get_driver_ip", lambda: callable(network.get_driver_ip)),
        (
            "horovod.runner.driver.driver_service.get_common_interfaces",
            lambda: callable(driver_service.get_common_interfaces),
        ),
    ]


def find_port_on(
    address: str, guard: rendezvous.Guard | None = None
) -> Callable[[Callable[[tuple[str, int]], Any]], tuple[Any, int]]:
    """horovod's find_port(server_factory), binding `address` (a port the kernel picks) instead of
    every interface, with `guard` installed on the server before it serves."""

    def find_port(server_factory: Callable[[tuple[str, int]], Any]) -> tuple[Any, int]:
        server = server_factory((address, 0))  # a socketserver: server_address is what it bound
        if guard is not None:
            guard.install(server)
        return server, server.server_address[1]

    return find_port


def bind_rendezvous_to_server_ip(guard: rendezvous.Guard | None = None, driver_address: str | None = None) -> None:
    """Make horovodrun's rendezvous server listen on the server_ip it tells the ranks, behind `guard`.

    driver_address: that server_ip, as the session knows the hosts reach this machine, instead of
    horovod's get_driver_ip (this machine's address on the interface of the first name it was given,
    which it need not have: the name is the hosts')."""
    rendezvous.require_horovod(_checks(), "to keep horovodrun's rendezvous off the network")
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    if driver_address is not None:
        network.get_driver_ip = lambda nics: driver_address  # launch.py and gloo_run.py call it through the module
    launch_gloo = gloo_run.launch_gloo

    def launch_gloo_on_server_ip(*args: Any, **kwargs: Any) -> Any:
        arguments = inspect.signature(launch_gloo).bind(*args, **kwargs).arguments
        if guard is not None:
            guard.set_hosts(host_names(arguments["settings"].hosts))
        http_server.find_port = find_port_on(arguments["server_ip"], guard)
        return launch_gloo(*args, **kwargs)

    gloo_run.launch_gloo = launch_gloo_on_server_ip
    gloo_run.launch_gloo_elastic = _elastic_on_server_ip(gloo_run.launch_gloo_elastic, guard)


def host_names(hosts: str) -> list[str]:
    """The names in horovodrun's -H ('a:2,b:1')."""
    return [item.strip().rsplit(":", 1)[0] for item in hosts.split(",") if item.strip()]


def _elastic_on_server_ip(
    launch_gloo_elastic: Callable[..., Any], guard: rendezvous.Guard | None = None
) -> Callable[..., Any]:
    from horovod.runner.driver import driver_service
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    def launch_gloo_elastic_on_server_ip(*args: Any, **kwargs: Any) -> Any:
        settings = inspect.signature(launch_gloo_elastic).bind(*args, **kwargs).arguments["settings"]
        if guard is not None:
            if guard.key is None:
                raise RuntimeError(
                    f"an elastic run's rendezvous unpickles what ranks send it: give the run's key in a 0600 file "
                    f"named by {rendezvous.KEY_FILE_ENV} (run_horovod does)"
                )
            record_hosts(settings.discovery, guard)
        if not settings.nics:
            # As horovod finds them once hosts are up; given back as if passed (--network-interfaces).
            hosts = list(settings.discovery.find_available_hosts_and_slots())
            settings.nics = driver_service.get_common_interfaces(settings, hosts)
        http_server.find_port = find_port_on(network.get_driver_ip(settings.nics), guard)
        return launch_gloo_elastic(*args, **kwargs)

    return launch_gloo_elastic_on_server_ip


def record_hosts(discovery: Any, guard: rendezvous.Guard) -> None:
    """Each time horovod's driver asks `discovery` for the hosts (every second), `guard` admits those."""
    find = discovery.find_available_hosts_and_slots

    def find_available_hosts_and_slots() -> Any:
        found = find()
        guard.set_hosts(found)
        return found

    discovery.find_available_hosts_and_slots = find_available_hosts_and_slots


def main() -> None:
    path = os.environ.pop(rendezvous.KEY_FILE_ENV, None)  # before horovodrun copies the environment
    hosts_file = os.environ.pop(rendezvous.HOSTS_FILE_ENV, None) or None
    driver_address = os.environ.pop(commands.DRIVER_ADDRESS_ENV, None) or None
    if driver_address is not None:
        try:
            driver_address = str(ipaddress.ip_address(driver_address))
        except ValueError:
            sys.exit(f"cmlcluster: {commands.DRIVER_ADDRESS_ENV}={driver_address!r} is not an IP address")
    try:
        key = rendezvous.read_key_file(path) if path else None
    except (OSError, ValueError) as e:
        sys.exit(f"cmlcluster: the run's rendezvous key file {path} cannot be read ({e}); run the job again")
    bind_rendezvous_to_server_ip(rendezvous.Guard(key, hosts_file=hosts_file), driver_address)
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"  # what its usage and errors name
    sys.exit(run_commandline())


if __name__ == "__main__":
    main()
