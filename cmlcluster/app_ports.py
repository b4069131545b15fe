"""CML's web-app ports in workers (CDSW_APP_PORT, CDSW_READONLY_PORT, CDSW_PUBLIC_PORT) and each
worker's `app_url`, the address a browser opens to reach what listens on its CDSW_APP_PORT.

On CML every engine has an address of its own, the three ports are the same in every engine, and
CML's proxy serves them at https://<engine id>.<domain> (read-only-<id>., public-<id>.). Here:

- Workers with an address of their own (Capabilities.own_address: containers, pods) get CML's
  fixed ports; `app_url` is http://<ip_address>:<CDSW_APP_PORT>/.
- Workers that share their host's address (local processes, SSH hosts) get three free ports each,
  drawn on the session's machine (for SSH hosts a port drawn here is only likely free there).
- Where the notebook's browser is not on the session's machine (a JupyterHub single-user server:
  JUPYTERHUB_SERVICE_PREFIX is set) and jupyter-server-proxy is installed, `app_url` goes through
  it: <prefix>proxy/<port>/ for a worker on this machine, <prefix>proxy/<ip>:<port>/ for another
  (jupyter-server-proxy serves only hosts its host_allowlist names; localhost by default).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from . import ports, wire

NAMES = wire.APP_PORT_ENVS
# Workers with an address of their own: the same ports in each, as in CML's engines (CML's docs name
# the variables, not their values; these are the ones CML's engines are commonly seen with).
FIXED = (8100, 8090, 8080)
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


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
    prefix = environ.get("JUPYTERHUB_SERVICE_PREFIX", "")
    if prefix and _has_server_proxy():
        where = str(port) if host in LOOPBACK else f"{_bracketed(host)}:{port}"
        return f"{prefix.rstrip('/')}/proxy/{where}/"
    return f"http://{_bracketed(host)}:{port}/"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _has_server_proxy() -> bool:
    return importlib.util.find_spec("jupyter_server_proxy") is not None
