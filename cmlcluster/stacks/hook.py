"""In each rank, as its runner starts: a faulthandler dump of every thread on XRAY_SIGNAL, into a memory
file (memfd) that the worker's agent reads through /proc (gather.py). It is how an X-ray reads a rank:
no ptrace (which a kernel's or a container's policy may refuse, and which stops the process while
py-spy reads it), no process started per rank; the dump is written by the rank itself, in C, from the
signal's handler, so a rank blocked in a collective's C code, holding the GIL or not, answers as well.

Nothing on disk: the memory file goes with the process. Only the standard library is imported here.
The signal is a real-time one that neither Python nor the frameworks use; the agent sends it only to a
process that catches it (its SigCgt mask) and holds this file, never to one it would kill.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO

XRAY_SIGNAL = signal.SIGRTMIN + 6
MEMFD_NAME = "cmlcluster-xray"  # /proc/<pid>/fd/<n> reads "/memfd:cmlcluster-xray (deleted)"

_dumps: IO[str] | None = None  # kept open (and referenced) for as long as the process lives


def arm() -> None:
    """Dump every thread's stack into this process's memory file on XRAY_SIGNAL; once per process,
    and nothing where the platform has no memfd."""
    global _dumps
    if _dumps is not None or not hasattr(os, "memfd_create"):
        return
    try:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)  # a program it execs starts without it
    except OSError:
        return
    _dumps = open(fd, "w")
    faulthandler.register(XRAY_SIGNAL, file=_dumps, all_threads=True, chain=False)
