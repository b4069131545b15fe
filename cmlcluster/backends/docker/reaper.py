"""What removes a Docker session's containers and network when the session's process ends without
closing it (a kernel killed, kill -9):

    python -m cmlcluster.backends.docker.reaper SESSION_ID

The session starts it in a process group of its own with a pipe on its stdin whose only write end
the session holds, and never writes to it: the pipe reaches EOF when the session's process ends,
however it ends. This then removes the session's containers (their agents would end on their own
once the controller's heartbeat has been silent for the session's silence_timeout) and its network,
which nothing else would remove before the next session on the engine or `cmlcluster cleanup`. After
a session that closed, it finds nothing to remove.
"""

from __future__ import annotations

import contextlib
import os
import sys

from .engine import LABEL, connect, remove_network, session_network_name


def reap(session_id: str) -> None:
    import docker.errors

    client = connect()
    try:
        session = {"label": f"{LABEL}.session={session_id}"}
        for container in client.containers.list(all=True, filters=session, ignore_removed=True):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        remove_network(client, session_network_name(session_id))
    finally:
        client.close()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m cmlcluster.backends.docker.reaper SESSION_ID")
    while os.read(sys.stdin.fileno(), 1024):
        pass  # the session writes nothing: only EOF, its end, comes
    try:
        reap(sys.argv[1])
    except Exception as e:  # the engine gone too: `cmlcluster cleanup` is left to do it
        sys.exit(f"cmlcluster: could not remove session {sys.argv[1]}'s containers and network ({e}); run cleanup")


if __name__ == "__main__":
    main()
