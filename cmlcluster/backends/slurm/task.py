"""Runs on a Slurm node, as each worker's job step: ``python -m cmlcluster.backends.slurm.task -- <agent argv>``.

It does on the node what the local backend does on the session's machine: it starts the worker's agent
in a process group of its own, in a private working folder and temporary folder (removed at the end),
and ends everything the worker started when the step is signalled (srun passes on the session's TERM;
scancel and a time limit send theirs). It keeps the worker's processes as its children (a subreaper), so
that on clusters whose process tracking is only the process tree (proctrack/linuxproc) none of them
escapes the job. The agent's environment is this process's: srun's, which the session made (its env=
and cmlcluster's own, never on a command line). Its stdout and stderr, as one stream in the order they
were written (a traceback after what was printed before it), are the step's stdout: srun copies it
to the session. SIGUSR1 (srun's --signal before the time limit, which Slurm sends to every process of the
step, the worker's program's for it to checkpoint) does not end this launcher.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from types import FrameType

from ..._proc import descendants, end_group

GRACE = 5.0  # seconds between a stop's TERM and its KILL
GPUS_ENV = "CMLCLUSTER_SLURM_GPUS"  # the GPUs the worker asked for, set by the session's srun
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def main(argv: list[str]) -> int:
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m cmlcluster.backends.slurm.task -- <the worker's argv>", file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix=f"cmlcluster-slurm-{os.environ.get('SLURM_JOB_ID', 'job')}-")
    with contextlib.suppress(Exception):  # orphans of the worker become this process's children
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    env = dict(os.environ, TMPDIR=os.path.join(folder, "tmp"))
    if env.pop(GPUS_ENV, "") == "0":
        # Zero GPUs means none visible: Slurm sets CUDA_VISIBLE_DEVICES only for a job with GPUs, and a node
        # that does not fence devices off (no cgroup ConstrainDevices) shows every one to the others.
        env["CUDA_VISIBLE_DEVICES"] = ""
    work = os.path.join(folder, "work")
    os.mkdir(env["TMPDIR"], 0o700)
    os.mkdir(work, 0o700)
    try:
        process = subprocess.Popen(
            argv[1:], env=env, cwd=work, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"cmlcluster: could not start the worker ({argv[1]}): {e}", flush=True)
        return 127
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        if stopping.is_set():  # a second signal while the first one's stop runs
            return
        stopping.set()
        # On a thread: the handler returns at once, and this process's wait() below goes on.
        threading.Thread(target=_end, args=(process, GRACE), daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    # srun's --signal reaches every process of the step, the worker's too: here it only must not end this one.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        code = process.wait()
    finally:
        _end(process, 0)  # nothing the worker started outlives it
        shutil.rmtree(folder, ignore_errors=True)
    return 128 - code if code < 0 else code  # a signal's death as a shell says it: srun reports that code


def _end(process: subprocess.Popen[bytes], grace: float) -> None:
    """TERM the worker's group and every process below this one, KILL what is left after `grace` s."""
    end_group(process, grace, others=lambda: descendants(os.getpid()), reap=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
