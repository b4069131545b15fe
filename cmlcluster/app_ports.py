"""CML's web-app ports in workers (CDSW_APP_PORT, CDSW_READONLY_PORT, CDSW_PUBLIC_PORT) and each
worker's `app_url`, the address a browser opens to reach what listens on its CDSW_APP_PORT.

On CML every engine has an address of its own, the three ports are the same in every engine, and
CML's proxy serves them at https://<engine id>.<domain> (read-only-<id>., public-<id>.). Here:

- Workers with an address of their own (Capabilities.own_address: containers, pods) get CML's
  fixed ports; workers that share their host's address (local processes, SSH hosts) get three free
  ports each, drawn on the session's machine (for SSH hosts a port drawn here is only likely free there).
- In a kernel of a Jupyter server (server_proxy.base_url) where jupyter-server-proxy is installed,
  `app_url` goes through that server: <base url>proxy/<port>/ for a worker on this machine,
  <base url>proxy/<ip>:<port>/ for another (admitted by proxy_hosts.allow_workers when the server's
  config names it): it opens wherever the browser is. Elsewhere (a script, a console, nbclient)
  it is the worker's own http://<ip_address>:<port>/.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import ports, server_proxy, wire

NAMES = wire.APP_PORT_ENVS
# Workers with an address of their own: the same ports in each, as in CML's engines (CML's docs name
# the variables, not their values; these are the ones CML's engines are commonly seen with).
FIXED = (8100, 8090, 8080)


def pick(own_address: bool) -> tuple[int, int, int]:
    """One worker's three ports: CML's fixed ones where it has an address of its own, else free ones.

    Not reserved (ports.ports_to_listen_on's reserve): any web app binds them, and not every one
    binds with SO_REUSEADDR.
    """
    if own_address:
        return FIXED
    app, readonly, public = ports.ports_to_listen_on(3, reserve=False)
    return app, readonly, public


def environment(app_ports: tuple[int, ...]) -> dict[str, str]:
    """The variables a worker with these ports sees ({} for none)."""
    return {name: str(port) for name, port in zip(NAMES, app_ports, strict=True)} if app_ports else {}


def app_url(ip_address: str | None, port: int, environ: Mapping[str, str] = os.environ) -> str:
    """The address a browser opens for `port` on the worker at `ip_address`; it ends in "/" as CML's does."""
    host = ip_address or "127.0.0.1"
    prefix = server_proxy.base_url(environ)
    if prefix is not None and server_proxy.installed():
        return server_proxy.url(host, port, prefix=prefix)
    return f"http://{server_proxy.bracketed(host)}:{port}/"
