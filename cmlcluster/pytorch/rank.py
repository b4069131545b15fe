"""One process of a PyTorch run, as torchrun starts it on a worker, by path (see die_with_parent):

    python .../cmlcluster/pytorch/rank.py SCRIPT [ARGS...]        runs SCRIPT as ``python SCRIPT ARGS`` would
    python .../cmlcluster/pytorch/rank.py --function CALL RESULT   calls a pickled (fn, args, kwargs)

A failure leaves its traceback in torchrun's error file (as torch's ``record`` would), so
that the session can name the failed rank and quote it. Rank 0 pickles the function's return
value into RESULT. The exit status is what the script decided: the process ends through
cmlcluster._exit, which does what Python's exit does but leaves without finalizing the
interpreter, where Gloo's threads can abort a rank that finished. Its first line, on stdout and
stderr, is its rank marker (see say_ranks). Only the standard library, torch and cmlcluster's
_exit, runs.entry, pytorch.commands and pytorch.store (none of the session's side) are imported here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from typing import Any, NoReturn

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Die with torchrun (PR_SET_PDEATHSIG), which starts each process in a session of its own, where
    nothing else would end it if torchrun were killed.

    Armed first thing (this file runs by path, so that no package import comes before it), then
    checked against torchrun's pid (CMLCLUSTER_TORCHRUN_PID, from launch.py): a torchrun that died
    before the signal was armed is seen too.
    """
    if not sys.platform.startswith("linux"):
        return
    torchrun = int(os.environ.get("CMLCLUSTER_TORCHRUN_PID") or os.getppid())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != torchrun:
        os._exit(1)


def say_ranks() -> None:
    """The rank marker: torchrun's header on each line names only the local rank, and in an elastic
    run a process of a new round may have a new global rank (commands.TeedLines reads this)."""
    from cmlcluster.pytorch.commands import RANK_MARKER

    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
    marker = " ".join([RANK_MARKER, *(os.environ.get(name, "0") for name in names)])
    for stream in (sys.stdout, sys.stderr):
        print(marker, file=stream, flush=True)


def process_group_store() -> Any:
    """Rank 0 of an elastic run hosts its process group's store (torchrun's agent's store is not shared
    there: TORCH_DISABLE_SHARE_RDZV_TCP_STORE, node.py): made here first, on MASTER_ADDR only, where
    torch's own would listen on every interface; torch's init_process_group then uses this one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "False" or os.environ.get("RANK") != "0":
        return None
    from cmlcluster.pytorch.store import listening_store

    return listening_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


def release_process_group() -> None:
    """Destroy the default process group if the user's code left it, while the interpreter is whole.

    Gloo's threads stop before the atexit handlers run, as when the script destroys it itself.
    This alone does not keep a rank that finished from aborting at exit ("terminate called
    without an active exception", SIGABRT, pytorch/pytorch#190489): a DDP model, say, holds the
    group alive; exit_now does. Only after success: a rank that failed exits as it is, since
    destroying a group that other ranks still use can hang.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> NoReturn:
    die_with_parent()
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: this package's modules are not the user's top-level ones
    say_ranks()
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from cmlcluster._exit import exit_now, status_of
    from cmlcluster.runs.entry import run_function, run_script, user_frames

    errors = ErrorHandler()
    errors.initialize()
    try:
        store = process_group_store()  # noqa: F841  # serves while this process runs
        if argv[:1] == ["--function"] and len(argv) == 3:
            run_function(argv[1], argv[2], keep_value=os.environ.get("RANK") == "0")
        elif argv and not argv[0].startswith("--"):
            run_script(argv[0], argv[1:])
        else:
            sys.exit("usage: python -m cmlcluster.pytorch.rank SCRIPT [ARGS...] | --function CALL RESULT")
        status = 0
    except SystemExit as e:
        status = status_of(e)
    except BaseException as e:
        # As `python script` would show it, and in torchrun's error file for the session: the
        # exception from the user's code, without this wrapper's frames.
        e.__traceback__ = user_frames(e.__traceback__, [__file__])
        errors.record_exception(e)
        traceback.print_exception(e)
        status = 1
    if status == 0:
        try:
            release_process_group()
        except Exception:  # the script's work is done: say so, but it stays a success
            traceback.print_exc()
    # The script's end decides: not what Gloo's threads do while the interpreter finalizes.
    exit_now(status)


if __name__ == "__main__":
    main(sys.argv[1:])
