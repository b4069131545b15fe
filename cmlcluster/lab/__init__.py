"""The JupyterLab panel: every cmlcluster session on this machine, its workers, Stop, and their logs.

A Jupyter server extension (this package) behind a prebuilt JupyterLab 4 extension (`labextension/`,
built from the repository's labextension/ sources by scripts/build_labextension.sh), as
dask-labextension and ipyparallel ship theirs. The panel never talks to a kernel: it reads what every
session writes for `cmlcluster list` and `cmlcluster logs` (records.py, worker_logs.py,
session_summary.py), so it shows the sessions of every notebook and terminal, and keeps showing them
across a kernel restart and a page reload.

    sessions   what the panel shows: live, gone and kept sessions; a worker log's tail; stop (through
               the session's stop socket, cmlcluster/stop_socket.py: core, not the panel's); cleanup
    handlers   the REST API under /cmlcluster/ (jupyter_server's authentication, authorization and XSRF)

How Jupyter finds it: `pip install` puts the server extension's switch
(etc/jupyter/jupyter_server_config.d/cmlcluster.json) and the bundle
(share/jupyter/labextensions/cmlcluster-lab) into the environment as data files. The two functions below
are the modern packages' hooks that name the same things from inside the package:
`jupyter server extension enable cmlcluster.lab` and `jupyter labextension develop` read them. Nothing here
imports jupyter_server until the server loads the extension.
"""

from __future__ import annotations

from typing import Any

LABEXTENSION = "cmlcluster-lab"  # the npm package's name, and its folder under share/jupyter/labextensions


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "cmlcluster.lab"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    from .handlers import add_handlers

    add_handlers(server_app)
