"""Entry point of the session's ipyparallel controller process.

ipcontroller forks helper processes (its heart monitor among them) that would
outlive it, and keep pinging orphaned engines, if the session were killed.
So the controller runs in its own process group and holds a lifeline: the
read end of a pipe whose only write end the session holds. When the session
process ends, however it ends, the pipe reaches EOF and the whole group dies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _die_with_session() -> None:
    while os.read(sys.stdin.fileno(), 1024):
        pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> None:
    if os.getpgrp() != os.getpid():
        sys.exit("cmlcluster._controller must lead its own process group (start it with start_new_session=True)")
    threading.Thread(target=_die_with_session, name="lifeline", daemon=True).start()
    from ipyparallel.controller.app import main as launch_controller

    launch_controller()


if __name__ == "__main__":
    main()
