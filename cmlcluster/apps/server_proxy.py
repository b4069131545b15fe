"""Links a browser opens through the notebook server's jupyter-server-proxy: one place for a TensorBoard's
link (tensorboard_server.py) and each worker's `app_url` (apps/ports.py).

jupyter-server-proxy serves ``<base url>proxy/<port>/<path>`` from localhost:<port>, and
``<base url>proxy/<host>:<port>/<path>`` from any host its ``ServerProxy.host_allowlist`` admits
(localhost and 127.0.0.1 by default; proxy_hosts.allow_workers admits cmlcluster's workers). Such a
link works wherever the browser is, since the browser reaches the notebook server by definition; a
worker's own address works only where the browser can route to it (not a container's or a pod's,
behind JupyterHub or from a laptop).

The links are relative to the notebook server's page, as JupyterLab shows them in a cell's output.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Mapping

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def installed() -> bool:
    """Whether jupyter-server-proxy is installed in this Python (the notebook server's, as a kernel's is)."""
    return importlib.util.find_spec("jupyter_server_proxy") is not None


def base_url(environ: Mapping[str, str] = os.environ) -> str | None:
    """The base URL ("/", "/user/ada/") of the Jupyter server that started this kernel; None outside one.

    Under JupyterHub its JUPYTERHUB_SERVICE_PREFIX; else the server whose pid jupyter_client gave the
    kernel as JPY_PARENT_PID, by the jpserver-<pid>.json it keeps in Jupyter's runtime folder (a kernel
    that nbclient or a console started has a parent that keeps none).
    """
    hub = environ.get("JUPYTERHUB_SERVICE_PREFIX", "")
    if hub:
        return hub if hub.endswith("/") else hub + "/"
    parent = environ.get("JPY_PARENT_PID", "")
    return _server_base_url(parent, environ.get("JUPYTER_RUNTIME_DIR", "")) if parent.isdigit() else None


@functools.lru_cache(maxsize=8)
def _server_base_url(pid: str, runtime_dir: str) -> str | None:
    """From the server's jpserver-<pid>.json (read once: a server keeps its base URL while it runs)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return None
    try:
        with open(os.path.join(runtime_dir or jupyter_runtime_dir(), f"jpserver-{pid}.json")) as f:
            base = json.load(f).get("base_url")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(base, str) or not base.startswith("/"):
        return None
    return base if base.endswith("/") else base + "/"


def url(host: str, port: int, path: str = "", *, prefix: str = "/") -> str:
    """``{prefix}proxy/{port}{path}/`` for this machine, ``{prefix}proxy/{host}:{port}{path}/`` for another.

    It ends in "/": pages load what they need by relative URL (TensorBoard's, CML's app_url)."""
    where = str(port) if host in LOOPBACK else f"{bracketed(host)}:{port}"
    return f"{prefix}proxy/{where}{path}/"


def bracketed(host: str) -> str:
    """An IPv6 address in brackets, as URLs write it."""
    return f"[{host}]" if ":" in host else host
