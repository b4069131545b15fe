"""horovodrun, with its rendezvous listening on the one address the ranks dial:

    python -m cmlcluster.horovod.driver [horovodrun's arguments...]

The same as ``horovodrun [arguments]`` (horovod.runner.launch's own run_commandline), except that
the Gloo rendezvous, an HTTP server without authentication, binds the address horovodrun gives the
ranks (HOROVOD_GLOO_RENDEZVOUS_ADDR: 127.0.0.1 when every rank runs on this machine) instead of
every interface. Horovod has no option for it, so this wraps two of its private names, probed
before the run: an upgrade that renamed one fails with their names, not with a rendezvous open to
the network.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from .. import probes


def _checks() -> list[probes.Check]:
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server

    return [
        ("horovod.runner.http.http_server.find_port", lambda: callable(http_server.find_port)),
        (
            "horovod.runner.gloo_run.launch_gloo(..., server_ip)",
            lambda: "server_ip" in inspect.signature(gloo_run.launch_gloo).parameters,
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


def main() -> None:
    bind_rendezvous_to_server_ip()
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"  # what its usage and errors name
    sys.exit(run_commandline())


if __name__ == "__main__":
    main()
