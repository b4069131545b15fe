"""The end of a rank's process: the exit status its program decided, whatever finalization would do.

A rank whose program finished can still die on its way out: once CPython starts finalizing, a
Gloo thread that takes the GIL to drop a tensor kills the process with "terminate called without
an active exception" (SIGABRT; see pytorch/pytorch#179291), and torchrun or horovodrun then
report a failed run whose every rank finished. So a rank runner ends its process here: it does
what Python's own exit does while the interpreter is whole, then leaves without finalizing.

Only the standard library is imported here: the PyTorch rank runner imports nothing else of cmlcluster.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import traceback
from typing import NoReturn

# Status 120 is what Python exits with when it cannot flush stdout or stderr at the end.
UNFLUSHED_STATUS = 120
BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)


def status_of(stop: SystemExit) -> int:
    """The exit status Python gives a SystemExit that nothing caught: None is 0, a number is itself,
    anything else (sys.exit("message")) is printed to stderr and is 1."""
    code = stop.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # what the parent sees: sys.exit(256) is 0, sys.exit(-1) is 255
    print(code, file=sys.stderr)
    return 1


def exit_now(status: int) -> NoReturn:
    """End this process with `status`, as Python's exit would, short of finalizing the interpreter.

    In the order Py_FinalizeEx does it: wait for the threads that are not daemons (and run
    threading's own exit hooks, which join concurrent.futures' workers); run the atexit
    handlers (the user's, logging.shutdown, weakref.finalize's, multiprocessing's, torch's);
    flush stdout and stderr (status 120 if that fails, as Python's). Then every file still open
    is flushed, so that nothing written is lost, and the process ends with os._exit.

    Skipped, deliberately: destroying what the program left, garbage included (a DDP model
    holds the process group: destroying it is Gloo's teardown, where the abort lives), tearing
    down modules, and C-level exit handlers, C++ static destructors among them. So the __del__
    methods of what is left do not run; Python does not promise that they do at exit either.
    """
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:  # Ctrl-C while waiting for them: Python says so and goes on too
            traceback.print_exc()
    atexit._run_exitfuncs()  # prints what a handler raised and goes on, as at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            status = UNFLUSHED_STATUS
    flush_open_files()
    os._exit(status & 0xFF)


def flush_open_files() -> None:
    """Flush every buffered file object that is still open, as its deallocation at exit would have
    (a log opened and never closed, say): found among all objects, garbage not yet collected too."""
    for found in gc.get_objects():
        # By type, not isinstance: that would ask proxies their __class__ (torch's warn when asked).
        if issubclass(type(found), BUFFERED):
            with contextlib.suppress(Exception):
                if not found.closed:
                    found.flush()
