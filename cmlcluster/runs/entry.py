"""What a rank runs, for every framework's rank runner: a script as ``python SCRIPT ARGS`` would run it,
or a pickled function, and the traceback of a failure as the user's code raised it. Each arms its
X-ray dump first (stacks/hook.py). Only the standard library (and cloudpickle, for a function's value) is
imported here: ranks import none of the session's side.
"""

from __future__ import annotations

import os
import pickle
import runpy
import sys
from collections.abc import Collection
from types import TracebackType
from typing import Any

from ..stacks import hook as xray_hook


def run_script(script: str, args: list[str]) -> None:
    xray_hook.arm()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def run_function(call_file: str, result_file: str, keep_value: bool) -> None:
    """Call the pickled (fn, args, kwargs) in call_file; with keep_value (rank 0), pickle what it
    returned into result_file."""
    xray_hook.arm()
    with open(call_file, "rb") as f:
        fn, args, kwargs = pickle.load(f)  # noqa: S301  # written by this run's node, in a private folder
    value: Any = fn(*args, **kwargs)
    if keep_value:
        import cloudpickle

        with open(result_file, "wb") as f:
            cloudpickle.dump(value, f)


def user_frames(tb: TracebackType | None, runner_files: Collection[str]) -> TracebackType | None:
    """The traceback from the user's code on: without the runner's frames, this module's, nor runpy's."""
    skipped = {*runner_files, __file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in skipped:
        tb = tb.tb_next
    return tb
