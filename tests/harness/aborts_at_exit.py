"""A training script that finishes, then dies as Gloo kills ranks that finished: it aborts (SIGABRT)
once the interpreter finalizes. Run it (python aborts_at_exit.py LOG), never import it.

It aborts both ways it could: as a C++ static destructor (registered with __cxa_atexit, run by
exit() after Python finalized) and when module teardown destroys an object. Before that it leaves
work for Python's exit: a thread that is not a daemon, an atexit handler, a file never closed
(LOG.<RANK>).
"""

import atexit
import ctypes
import os
import sys
import threading
import time

libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)


class AbortsWhenDestroyed:
    def __del__(self, abort=os.abort):
        abort()


os.aborts_at_exit = AbortsWhenDestroyed()
log = open(sys.argv[1] + "." + os.environ.get("RANK", "0"), "w")  # never closed nor flushed
log.write("every line written")
atexit.register(print, "atexit handler ran", flush=True)


def later():
    time.sleep(0.3)
    print("thread finished", flush=True)


threading.Thread(target=later).start()
print("script finished", flush=True)
