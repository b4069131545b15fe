"""horovodrun, with its rendezvous listening on the one address the ranks dial:

    python -m cmlcluster.horovod.driver [horovodrun's arguments...]

The same as ``horovodrun [arguments]`` (horovod.runner.launch's own run_commandline), except that
the Gloo rendezvous, an HTTP server without authentication, binds the address horovodrun gives the
ranks (HOROVOD_GLOO_RENDEZVOUS_ADDR: 127.0.0.1 when every rank runs on this machine) instead of
every interface. Horovod has no option for it, so this wraps some of its private names, probed
before the run: an upgrade that renamed one fails with their names, not with a rendezvous open to
the network. An elastic run (launch_gloo_elastic) starts its rendezvous before it picks the address:
that address is worked out first here, the way horovod then does (the first of the interfaces
horovodrun was given, or found on the hosts discovered at start).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from .. import probes

ELASTIC_ARGUMENTS = ("settings", "get_common_interfaces", "rendezvous")


def _checks() -> list[probes.Check]:
    from horovod.runner import gloo_run
    from horovod.runner.driver import driver_service
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    return [
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


def find_port_on(address: str) -> Callable[[Callable[[tuple[str, int]], Any]], tuple[Any, int]]:
    """horovod's find_port(server_factory), binding `address` (a port the kernel picks) instead of
    every interface."""

    def find_port(server_factory: Callable[[tuple[str, int]], Any]) -> tuple[Any, int]:
        server = server_factory((address, 0))  # a socketserver: server_address is what it bound
        return server, server.server_address[1]

    return find_port


def bind_rendezvous_to_server_ip() -> None:
    """Make horovodrun's rendezvous server listen on the server_ip it tells the ranks."""
    missing = probes.missing(_checks())
    if missing:
        import horovod

        raise RuntimeError(
            f"Horovod {horovod.__version__} no longer has {', '.join(missing)}, which cmlcluster uses to keep "
            "horovodrun's rendezvous off the network; use a Horovod cmlcluster supports (0.28)"
        )
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server

    launch_gloo = gloo_run.launch_gloo

    def launch_gloo_on_server_ip(*args: Any, **kwargs: Any) -> Any:
        server_ip = inspect.signature(launch_gloo).bind(*args, **kwargs).arguments["server_ip"]
        http_server.find_port = find_port_on(server_ip)
        return launch_gloo(*args, **kwargs)

    gloo_run.launch_gloo = launch_gloo_on_server_ip
    gloo_run.launch_gloo_elastic = _elastic_on_server_ip(gloo_run.launch_gloo_elastic)


def _elastic_on_server_ip(launch_gloo_elastic: Callable[..., Any]) -> Callable[..., Any]:
    from horovod.runner.driver import driver_service
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    def launch_gloo_elastic_on_server_ip(*args: Any, **kwargs: Any) -> Any:
        settings = inspect.signature(launch_gloo_elastic).bind(*args, **kwargs).arguments["settings"]
        if not settings.nics:
            # As horovod finds them once hosts are up; given back as if passed (--network-interfaces).
            hosts = list(settings.discovery.find_available_hosts_and_slots())
            settings.nics = driver_service.get_common_interfaces(settings, hosts)
        http_server.find_port = find_port_on(network.get_driver_ip(settings.nics))
        return launch_gloo_elastic(*args, **kwargs)

    return launch_gloo_elastic_on_server_ip


def main() -> None:
    bind_rendezvous_to_server_ip()
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"  # what its usage and errors name
    sys.exit(run_commandline())


if __name__ == "__main__":
    main()
