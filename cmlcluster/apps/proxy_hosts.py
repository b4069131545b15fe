"""Which hosts the notebook server's jupyter-server-proxy may reach: its own default (localhost,
127.0.0.1) and the addresses of this user's running cmlcluster workers, nothing else.

jupyter-server-proxy proxies ``<base url>proxy/<host>:<port>/`` only to hosts its
``ServerProxy.host_allowlist`` admits: a list, or a function of (handler, host). cmlcluster never sets
it by itself (a proxy open to more hosts is the server owner's choice); to open each worker's
`app_url` (apps/ports.py) through the server, its config names this function:

    # jupyter_server_config.py, in ~/.jupyter or the environment's etc/jupyter
    from cmlcluster.apps.proxy_hosts import allow_workers
    c.ServerProxy.host_allowlist = allow_workers

A host is admitted while a worker of a session alive on this machine runs at that address, by the
session records that `cmlcluster list` reads (records.py: the user's own private folder, the same
one only when the server and the kernels see the same CMLCLUSTER_STATE_DIR or XDG_RUNTIME_DIR).
Every port of that host is admitted: the proxy asks about hosts only.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import origin, records
from ..errors import ConfigError
from ..workers import RUNNING

log = logging.getLogger(__name__)

PROXY_DEFAULT = frozenset({"localhost", "127.0.0.1"})  # jupyter-server-proxy's own host_allowlist default


def allow_workers(handler: Any, host: str) -> bool:
    """ServerProxy.host_allowlist: jupyter-server-proxy's default hosts, and running workers' addresses."""
    return host in PROXY_DEFAULT or host.strip("[]") in worker_addresses()


def worker_addresses() -> frozenset[str]:
    """The ip_address of every running worker of the live sessions on this machine (a few small files
    read per request: no state kept that a stopped worker could outlive). No controller is asked about a
    gone session's record: the proxy calls this on the notebook server's loop, for every request."""
    try:
        found = records.records(probe=False)
    except (ConfigError, OSError) as e:
        log.warning("cmlcluster: no worker is admitted to jupyter-server-proxy: %s", e)
        return frozenset()
    return frozenset(
        str(worker["ip_address"])
        for record in found
        if record.get("state") == origin.ALIVE
        for worker in record.get("workers") or ()
        if isinstance(worker, dict) and worker.get("status") == RUNNING and worker.get("ip_address")
    )
