"""CML's web-app ports in workers (CDSW_APP_PORT, CDSW_READONLY_PORT, CDSW_PUBLIC_PORT) and each
worker's `app_url`, the address a browser opens to reach what listens on its CDSW_APP_PORT.

On CML every engine has an address of its own, the three ports are the same in every engine, and
CML's proxy serves them at https://<engine id>.<domain> (read-only-<id>., public-<id>.), reaching an
app that listens on 127.0.0.1 inside the engine, as CML's docs tell apps to. Here:

- Workers with an address of their own (Capabilities.own_address: containers, pods) get CML's
  fixed ports; workers that share their host's address (local processes, SSH hosts) get three free
  ports each, drawn on the session's machine (for SSH hosts a port drawn here is only likely free there).
- Where a worker's address is not this machine's loopback (every backend but local: containers, pods,
  SSH hosts), its agent relays a fourth port on that address to 127.0.0.1:<CDSW_APP_PORT>
  (apps/forward.py), and `app_url` names that port: an app bound to 127.0.0.1, as CML's, is reached
  from outside the worker, and one bound to 0.0.0.0 too. The fourth port is fixed where the worker
  has an address of its own (FORWARD_FIXED), drawn with the others where it shares its host's.
- In a kernel of a Jupyter server (server_proxy.base_url) where jupyter-server-proxy is installed,
  `app_url` goes through that server: <base url>proxy/<port>/ for a worker on this machine,
  <base url>proxy/<ip>:<port>/ for another (admitted by proxy_hosts.allow_workers when the server's
  config names it): it opens wherever the browser is. Elsewhere (a script, a console, nbclient)
  it is the worker's own http://<ip_address>:<port>/.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .. import ports, wire
from . import server_proxy

NAMES = wire.APP_PORT_ENVS
# Workers with an address of their own: the same ports in each, as in CML's engines (CML's docs name
# the variables, not their values; these are the ones CML's engines are commonly seen with).
FIXED = (8100, 8090, 8080)


# The forwarder's port where the worker has an address of its own: beside CDSW_APP_PORT, and no common
# app's default (an app binding it on 0.0.0.0 would find it taken).
FORWARD_FIXED = 8101


def pick(own_address: bool, session_host: bool) -> tuple[int, ...]:
    """One worker's ports: CDSW_APP_PORT, CDSW_READONLY_PORT, CDSW_PUBLIC_PORT, then the forwarder's
    where the worker's address is not this machine's loopback (forwarded). CML's fixed ones where it
    has an address of its own, else free ones.

    Not reserved (ports.ports_to_listen_on's reserve): any web app binds them, and not every one
    binds with SO_REUSEADDR.
    """
    if own_address:
        return (*FIXED, FORWARD_FIXED)
    return tuple(ports.ports_to_listen_on(4 if forwarded(own_address, session_host) else 3, reserve=False))


def forwarded(own_address: bool, session_host: bool) -> bool:
    """Whether a worker's address is not this machine's loopback, so that its agent relays its app
    (local workers run here, on the loopback, where app_url reaches the app itself)."""
    return own_address or not session_host


def environment(app_ports: tuple[int, ...]) -> dict[str, str]:
    """The variables a worker with these ports (pick's) sees ({} for none)."""
    env = {name: str(port) for name, port in zip(NAMES, app_ports[: len(NAMES)], strict=True)}
    if len(app_ports) > len(NAMES):
        env[wire.APP_FORWARD_PORT_ENV] = str(app_ports[len(NAMES)])
    return env


def browser_port(app_ports: tuple[int, ...]) -> int:
    """The port app_url names for a worker with these ports (pick's): its forwarder's where it has one."""
    return app_ports[len(NAMES)] if len(app_ports) > len(NAMES) else app_ports[0]


def worker_app_url(ip_address: str | None, app_ports: tuple[int, ...], environ: Mapping[str, str] = os.environ) -> str:
    """A worker's `app_url`: app_url for the port a browser reaches its CDSW_APP_PORT at."""
    return app_url(ip_address, browser_port(app_ports), environ)


def app_url(ip_address: str | None, port: int, environ: Mapping[str, str] = os.environ) -> str:
    """The address a browser opens for `port` on the worker at `ip_address`; it ends in "/" as CML's does."""
    host = ip_address or "127.0.0.1"
    prefix = server_proxy.base_url(environ)
    if prefix is not None and server_proxy.installed():
        return server_proxy.url(host, port, prefix=prefix)
    return f"http://{server_proxy.bracketed(host)}:{port}/"
