"""Entry point of the session's ipyparallel controller process.

ipcontroller forks helper processes (its heart monitor among them) that would
outlive it, and keep pinging orphaned engines, if the session were killed. So the
controller runs in its own process group and holds a lifeline (_lifeline.py):
when the session process ends, however it ends, the whole group dies, after
removing the session's folder (its keys, logs and workers' temp files), which a
killed session could not remove itself.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os

from .. import _lifeline, _redact
from . import ipyparallel_internals

# Created in the session's folder once the controller listens: the session wrote the connection
# files before the controller started (control/plane.py), so their presence says nothing.
LISTENING_FILE = "controller.listening"


def main() -> None:
    session_dir = os.environ.get("CMLCLUSTER_SESSION_DIR", "")
    _lifeline.hold(_lifeline.remove_folder(session_dir) if session_dir else None)
    _redact.hide(*secrets(session_dir))  # at DEBUG, the hub logs its connection info, key and all
    from ipyparallel.controller.app import IPController

    ipyparallel_internals.announce_new_hearts_at_once()
    ipyparallel_internals.no_sleep_in_hub_start()
    # The heart monitor is a process the hub forks: forked, it has the change above (Python 3.14's
    # default, forkserver, would import ipyparallel afresh in it).
    multiprocessing.set_start_method("fork", force=True)
    # What ipyparallel's main() does (IPController.launch_instance), with the word in between.
    controller = IPController.instance()
    controller.initialize()  # binds the hub's sockets
    if session_dir:
        open(os.path.join(session_dir, LISTENING_FILE), "x").close()
    controller.start()


def secrets(session_dir: str) -> list[str]:
    """The session's signing key (from the connection file the session wrote for the controller to read)
    and the controller's CurveZMQ secret key (from its environment): what its log must never hold."""
    found = [os.environ.get("IPP_CURVE_SECRETKEY", "")]
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(session_dir, "ipython", "security", "ipcontroller-engine.json")) as f:
            found.append(str(json.load(f).get("key", "")))
    return found


if __name__ == "__main__":
    main()
