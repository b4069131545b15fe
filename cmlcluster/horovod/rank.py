"""Runs one Horovod rank on a worker reached through its sshd: ``python -m cmlcluster.horovod.rank script args``.

horovodrun runs the same command on every host, but a shipped script lies in a folder of each
worker's own. The worker's sshd tells its sessions where (CMLCLUSTER_WORKDIR, CMLCLUSTER_FILES,
see cmlcluster.ssh.sshd); this runs the script from there, as ``python script args`` would, and
ends with the status the script decided: through cmlcluster._exit, which leaves without
finalizing the interpreter, where Horovod's Gloo threads could abort a rank that finished.

The run's env= is not on the command line (horovodrun would put it on every rank's ssh or
`env` command line, which `ps` shows every user): it is in the 0600 file that
CMLCLUSTER_RANK_ENV names (cmlcluster.ssh.sshd:set_rank_env; on the local backend, a file in the
session's folder that also holds the notebook's environment). The rank starts again with it in
its environment, so that variables read as Python starts (PYTHONPATH, LD_PRELOAD, PYTHONHASHSEED)
work as they would from a shell.

In an elastic run that file also holds the run's rendezvous key: the rank takes it out of its
environment (the script and what it starts never see it) and signs with it the registration
horovod's hvd.elastic.run sends the rendezvous (cmlcluster.horovod.rendezvous).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import NoReturn

from .._exit import exit_now, status_of
from ..stacks import hook as xray_hook
from ..wire import RANK_ENV_FILE_ENV
from . import rendezvous

RANK_MODULE = "cmlcluster.horovod.rank"


def with_run_env(argv: list[str]) -> None:
    """Start this rank again with the run's env= in its environment, when the run has one.

    The variable naming the file goes first, so the new process runs the script at once.
    """
    path = os.environ.pop(RANK_ENV_FILE_ENV, None)
    if not path:
        return
    try:
        with open(path) as f:
            env = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"cmlcluster: this run's env= file {path} cannot be read ({e}); run the job again")
    if env:
        # The same interpreter and module, argv as given: nothing from a shell.
        os.execve(sys.executable, [sys.executable, "-m", RANK_MODULE, *argv], {**os.environ, **env})  # noqa: S606


def sign_registration() -> None:
    """With the run's rendezvous key in the environment (an elastic run), sign this rank's registration."""
    text = os.environ.pop(rendezvous.KEY_ENV, None)
    if text is None:
        return
    try:
        rendezvous.sign_worker_registration(rendezvous.parse_key(text))
    except (ValueError, RuntimeError, ImportError) as e:
        sys.exit(f"cmlcluster: this rank cannot sign its elastic registration ({e}); the rendezvous would refuse it")


def run_script(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m cmlcluster.horovod.rank SCRIPT [ARGS...]")
    script, args = argv[0], argv[1:]
    workdir = os.environ.get("CMLCLUSTER_WORKDIR")
    if workdir:
        os.chdir(workdir)  # relative data paths work as they do in the worker
    if not os.path.isabs(script):
        script = os.path.join(os.environ.get("CMLCLUSTER_FILES") or os.getcwd(), script)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> NoReturn:
    with_run_env(argv)
    xray_hook.arm()  # where an X-ray finds this rank's stacks if py-spy cannot attach (stacks/hook.py)
    try:
        sign_registration()
        run_script(argv)
        status = 0
    except SystemExit as e:
        status = status_of(e)
    except BaseException as e:
        sys.excepthook(type(e), e, e.__traceback__)  # as Python shows what nothing caught
        status = 1
    exit_now(status)


if __name__ == "__main__":
    main(sys.argv[1:])
