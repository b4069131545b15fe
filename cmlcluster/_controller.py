"""Entry point of the session's ipyparallel controller process.

ipcontroller forks helper processes (its heart monitor among them) that would
outlive it, and keep pinging orphaned engines, if the session were killed.
So the controller runs in its own process group and holds a lifeline: the
read end of a pipe whose only write end the session holds. When the session
process ends, however it ends, the pipe reaches EOF and the whole group dies,
after removing the session's folder (its keys, logs and workers' temp files),
which a killed session could not remove itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading


def _die_with_session(session_dir: str) -> None:
    while os.read(sys.stdin.fileno(), 1024):
        pass
    if session_dir:
        shutil.rmtree(session_dir, ignore_errors=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> None:
    if os.getpgrp() != os.getpid():
        sys.exit("cmlcluster._controller must lead its own process group (start it with start_new_session=True)")
    session_dir = os.environ.get("CMLCLUSTER_SESSION_DIR", "")
    threading.Thread(target=_die_with_session, args=(session_dir,), name="lifeline", daemon=True).start()
    from ipyparallel.controller.app import main as launch_controller

    launch_controller()


if __name__ == "__main__":
    main()
