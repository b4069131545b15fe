"""Running a worker's program in its engine: a script, CML code, or a function; its exit code.

CML code is run as CML's engine, an IPython kernel, runs a cell: `!cmd` lines run through
`run_shell` (streams kept apart, copied line by line), `%magic` lines as magics. The stop
signal's handler (agent_engine.AgentEngine) ends a running program through `stop_program`.
"""

from __future__ import annotations

import ast
import importlib
import linecache
import runpy
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from IPython import get_ipython

from ..control import ipyparallel_internals
from .files import say_leftovers, script_path, unpack_files

_program_running = False  # whether run_program runs the worker's program now (until a stop interrupts it)
_in_program = False  # whether run_program has yet to return: the program, or its cleanup after a stop


class ProgramStopped(BaseException):
    """Raised in the worker's program by the stop signal's handler, which runs in it."""

    def __init__(self, signal: int):
        super().__init__(f"stopped by signal {signal}")
        self.signal = signal


def call(target: str, *args: Any) -> Any:
    """Call "package.module:function" with args; how the session runs code in a worker."""
    module_name, _, function = target.partition(":")
    return getattr(importlib.import_module(module_name), function)(*args)


def run_program(
    script: str,
    code: str,
    target: str = "",
    args: tuple[Any, ...] = (),
    files: bytes = b"",
    files_in_cwd: bool = False,
) -> int:
    """Run the worker's program in this engine and return its exit code.

    Behaves like ``python script`` / ``python -c code``, code run as an IPython cell (run_cell): a
    traceback goes to stderr and gives exit code 1; SystemExit gives its code; a stop signal -signal.
    A target function's return value is its exit code (None is 0).
    """
    global _program_running, _in_program
    _program_running = _in_program = True
    try:
        if files:
            unpack_files(files, files_in_cwd)
        if script:
            script = script_path(script)
            sys.argv = [script]
            runpy.run_path(script, run_name="__main__")
        elif code:
            return run_cell(code)
        elif target:
            return int(call(target, *args) or 0)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except ProgramStopped as e:
        say_leftovers()  # the session cannot ask a busy worker what its folder holds: it is said here
        return -e.signal
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        _program_running = False
        _wait_for_captured_output()
        sys.stdout.flush()
        sys.stderr.flush()
        _in_program = False
    return 0


CAPTURE_DRAIN_SECONDS = 1.0


def _wait_for_captured_output() -> None:
    """Let the engine's fd watcher threads read what child processes wrote before the program ends.

    A child's output goes into a pipe that a thread of the engine reads; flushing sys.stdout does
    not wait for that thread, so a child that printed just before the program returned could lose
    its lines (seen: `subprocess.run(['echo', ...])` as a program's last line, on an SSH host). Both
    pipes must read empty twice, 20 ms apart (the thread then has written what it read), at most
    CAPTURE_DRAIN_SECONDS.
    """
    deadline = time.monotonic() + CAPTURE_DRAIN_SECONDS
    empty_before = False
    while time.monotonic() < deadline:
        empty = all(ipyparallel_internals.captured_fd_unread(s) == 0 for s in (sys.stdout, sys.stderr))
        if empty and empty_before:
            return
        empty_before = empty
        time.sleep(0.02)


def stop_program(signal: int) -> None:
    """In the stop signal's handler: end the running program now (its finally blocks run), once.

    Raises ProgramStopped into the program when one runs; a second signal must not interrupt the
    program's cleanup, so after the first this does nothing.
    """
    global _program_running
    if _program_running:
        _program_running = False
        raise ProgramStopped(signal)


def in_program() -> bool:
    """Whether run_program has yet to return: the program runs, or its cleanup after a stop does."""
    return _in_program


CELL_FILE = "<worker code>"  # the file name a cell's code runs as


def run_cell(code: str) -> int:
    """Run `code` as CML's engine, an IPython kernel, runs a cell; return its exit code.

    Notebooks pass code as an indented triple-quoted string, with `!cmd` and `%magic` lines. A cell
    that is one `!cmd` exits with the command's exit code, as ``sh -c cmd``; a `!cmd` among other
    lines only sets ``_exit_code``, as in IPython. Runs in a namespace of its own, as ``__main__``.
    """
    source = cell_source(code)
    compiled = compile(source, CELL_FILE, "exec")
    # Its lines, for a traceback's and an X-ray's frames in it (stacks/gather.py), as IPython keeps a cell's.
    linecache.cache[CELL_FILE] = (len(source), None, source.splitlines(True), CELL_FILE)
    namespace: dict[str, Any] = {"__name__": "__main__", "get_ipython": get_ipython}
    with shell_commands_into_streams(namespace):
        exec(compiled, namespace)  # noqa: S102
    return int(namespace.get("_exit_code", 0)) if is_one_shell_command(source) else 0


def cell_source(code: str) -> str:
    """The Python source IPython makes of a cell: common leading indentation dropped, `!cmd` lines as
    ``get_ipython().system(...)``, `%magic` lines as ``get_ipython().run_line_magic(...)``."""
    from IPython.core.inputtransformer2 import TransformerManager

    return str(TransformerManager().transform_cell(code))


_SYSTEM = ast.dump(ast.parse("get_ipython().system", mode="eval").body)


def is_one_shell_command(source: str) -> bool:
    """Whether a cell's source (cell_source) is one `!cmd` and nothing else."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        return False
    return ast.dump(body[0].value.func) == _SYSTEM


@contextmanager
def shell_commands_into_streams(namespace: dict[str, Any]) -> Iterator[None]:
    """While a cell runs, the engine shell's `!cmd` (its ``system``) runs through run_shell.

    ipykernel's own runs the command in a terminal (pexpect), which merges stderr into stdout and ends
    lines with CRLF; run_shell keeps the streams apart, copies them line by line, and ends the command
    when the program is stopped. The exit code goes into the cell's namespace as ``_exit_code``, where
    IPython puts it for a cell. Magics that run commands (%pip) go through it too.
    """
    shell = get_ipython()
    if shell is None:  # not in an engine (nothing to run `!cmd`); the agent always is
        yield
        return

    def system(cmd: str) -> None:
        # depth=1: $name and {expr} are expanded in the cell's namespace, the caller of this function.
        exit_code = run_shell(shell.var_expand(cmd, depth=1))
        namespace["_exit_code"] = exit_code
        if getattr(shell, "system_raise_on_error", False) and exit_code != 0:
            raise subprocess.CalledProcessError(exit_code, cmd)

    own = vars(shell).get("system")  # one set on the shell itself (ip.system = ip.system_raw) is kept
    shell.system = system
    try:
        yield
    finally:
        if own is None:
            del shell.system
        else:
            shell.system = own


def run_shell(command: str) -> int:
    """`sh -c command`, its output copied line by line into this engine's streams; its exit code.

    Not onto the inherited descriptors: what a child writes there reaches the session only through
    the engine's descriptor capture, a thread that can send it after the program's end was reported
    (a worker's last lines then went missing). Copied here, all of it is sent before run_program returns.
    """
    with subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        pipes = ((child.stdout, sys.stdout), (child.stderr, sys.stderr))
        copiers = [threading.Thread(target=_copy_lines, args=pair, daemon=True) for pair in pipes]
        try:
            for copier in copiers:
                copier.start()
            for copier in copiers:
                copier.join()
            return child.wait()
        except BaseException:  # an interrupt: the command does not outlive its program
            child.kill()
            raise


def _copy_lines(pipe: Any, stream: Any) -> None:
    for line in iter(pipe.readline, b""):
        stream.write(line.decode(errors="replace"))
