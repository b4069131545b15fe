"""Runs on an SSH host, one per worker: ``python -m cmlcluster.backends.ssh_remote``, started over ssh.

It does on the host what the local backend does on the session's machine: it starts the
worker's agent in a process group of its own, in a private working folder (removed at the end),
with CPU and memory limits where the host's cgroups allow, and ends everything the worker started
when asked. The SSH backend talks to it through the ssh connection's stdin:

- the first line is the request, as JSON: the worker's argv, its environment (only what the
  session sends: the user's env= and cmlcluster's own, never on a command line where `ps`
  would show it), its id and resources;
- then ``stop <grace>`` ends the worker: TERM to its group and to everything below it (an
  sshd's logins start sessions of their own), KILL after grace seconds;
- end of input (the session closed the connection, or died) does the same.

The agent's output (its stdout and stderr, as one stream) goes to this process's stdout, which ssh
carries back. The exit code is the agent's (128+N when a signal N killed it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from .._proc import descendants, end_group
from ..resources import CgroupLimits

DEFAULT_GRACE = 5.0
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# What a worker keeps of the login's environment on its host: the host's own, never the session's.
LOGIN_VARIABLES = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL")


def _become_subreaper() -> None:
    """Orphans of the worker (its agent died first) become this process's children, so none escapes."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _end(process: subprocess.Popen[bytes], grace: float) -> None:
    """TERM the worker's group and everything below this process (an sshd's logins leave the group);
    KILL what is left after grace. Reaped by the main thread's wait(): this may run in a signal handler."""
    end_group(process, grace, others=lambda: descendants(os.getpid()), reap=False)


def _listen(process: subprocess.Popen[bytes]) -> None:
    """Wait on stdin for `stop <grace>` or its end, then stop the worker."""
    grace = DEFAULT_GRACE
    for line in sys.stdin:
        word, _, value = line.strip().partition(" ")
        if word == "stop":
            with contextlib.suppress(ValueError):
                grace = float(value)
            break
    _end(process, grace)


def main() -> None:
    request: dict[str, Any] = json.loads(sys.stdin.readline())
    worker_id = str(request["worker_id"])
    folder = tempfile.mkdtemp(prefix=f"cmlcluster-{worker_id}-")
    env = {k: os.environ[k] for k in LOGIN_VARIABLES if k in os.environ}
    env.update(request["env"])
    env["TMPDIR"] = os.path.join(folder, "tmp")  # the worker's temp files go with its folder
    os.mkdir(env["TMPDIR"])
    work = os.path.join(folder, "work")
    os.mkdir(work)
    limits = CgroupLimits(f"cmlcluster-{worker_id}", float(request["cpu"]), float(request["memory"]))
    argv = [sys.executable, *request["argv"][1:]]  # the interpreter this runs on is the worker's
    code = 1
    _become_subreaper()
    try:
        # Its stderr joins its stdout here: two streams over ssh arrive in either order, and a worker's
        # last words (a traceback) must come after what it printed before them, as they do locally.
        process = subprocess.Popen(
            argv, env=env, cwd=work, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
        limits.add(process.pid)
        # SIGTERM or SIGHUP to this process (sshd going down, say) stops the worker like `stop`.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: _end(process, DEFAULT_GRACE))
        threading.Thread(target=_listen, args=(process,), daemon=True).start()
        code = process.wait()
        _end(process, 0)  # the agent is gone; whatever its program left goes too
    finally:
        limits.remove()
        shutil.rmtree(folder, ignore_errors=True)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
