"""Runs one Horovod rank on a worker reached through its sshd: ``python -m cmlcluster.horovod.rank script args``.

horovodrun runs the same command on every host, but a shipped script lies in a folder of each
worker's own. The worker's sshd tells its sessions where (CMLCLUSTER_WORKDIR, CMLCLUSTER_FILES,
see cmlcluster.ssh.sshd); this runs the script from there, as ``python script args`` would.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1:])
