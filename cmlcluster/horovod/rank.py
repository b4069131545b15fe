"""Runs one Horovod rank on a worker reached through its sshd: ``python -m cmlcluster.horovod.rank script args``.

horovodrun runs the same command on every host, but a shipped script lies in a folder of each
worker's own. The worker's sshd tells its sessions where (CMLCLUSTER_WORKDIR, CMLCLUSTER_FILES,
see cmlcluster.ssh.sshd); this runs the script from there, as ``python script args`` would, and
ends with the status the script decided: through cmlcluster._exit, which leaves without
finalizing the interpreter, where Horovod's Gloo threads could abort a rank that finished.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NoReturn

from .._exit import exit_now, status_of


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
    try:
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
