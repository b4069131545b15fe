"""Processes that die with the session, however the session ends (kill -9 included).

A process started by the session in a process group of its own holds a lifeline:
the read end of a pipe (its stdin) whose only write end the session holds. When
the session process ends, the pipe reaches EOF and the lifeline thread kills the
whole group. ``python path/to/_lifeline.py -- argv...`` runs any command that
way (horovodrun, whose own helpers end the ranks when it dies); it imports only
the standard library, so it runs by path where cmlcluster is not importable. The
controller holds a lifeline too (control/controller.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable


def hold(before_dying: Callable[[], None] | None = None) -> None:
    """Start the lifeline thread on stdin; this process must lead its own process group."""
    if os.getpgrp() != os.getpid():
        sys.exit(f"{sys.argv[0]} must lead its own process group (start it with start_new_session=True)")

    def wait_for_the_session() -> None:
        while os.read(sys.stdin.fileno(), 1024):
            pass
        if before_dying is not None:
            before_dying()
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=wait_for_the_session, name="lifeline", daemon=True).start()


# The write ends of lifelines this process holds, each with its file's identity (st_dev, st_ino): a number
# closed since and reused for another file is told apart, so that no entry needs removing.
_held: dict[int, tuple[int, int]] = {}
_fork_hook = False


def guard(fd: int) -> None:
    """Keep the lifeline write end `fd` out of this process's forked children. fork copies every descriptor,
    exec or not (multiprocessing's "fork" start method, a DataLoader's workers): a child holding the write end
    would keep the lifeline alive after this process dies. In a forked child it becomes /dev/null at once."""
    global _fork_hook
    for number, identity in list(_held.items()):  # forget those closed since
        if _identity(number) != identity:
            del _held[number]
    held = _identity(fd)
    if held is not None:
        _held[fd] = held
    if not _fork_hook:
        os.register_at_fork(after_in_child=_drop_in_child)
        _fork_hook = True


def guard_stdin(process: object) -> None:
    """guard() the write end of a started process's stdin pipe: a subprocess.Popen's, or an asyncio one's."""
    stdin = getattr(process, "stdin", None)
    transport = getattr(stdin, "transport", None)
    pipe = transport.get_extra_info("pipe") if transport is not None else stdin
    if pipe is not None:
        guard(pipe.fileno())


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _drop_in_child() -> None:
    if not _held:
        return
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for fd, identity in _held.items():
            if _identity(fd) == identity:
                os.dup2(null, fd, inheritable=False)  # the number stays valid: whoever closes it later may
    finally:
        os.close(null)
    _held.clear()


def remove_folder(path: str) -> Callable[[], None]:
    return lambda: shutil.rmtree(path, ignore_errors=True)


def _terminate(started: list[subprocess.Popen[bytes]], grace: float) -> None:
    for child in started:
        child.terminate()
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            pass  # the group is killed all the same


AT_ONCE = 32  # commands --for-each-line runs together: a scheduler's controller answers each


def for_each_line(command: list[str], timeout: float = 10.0) -> None:
    """Once the session's end of stdin closes: `command` with each line the session wrote on it as its last
    argument, AT_ONCE of them together. What lives beyond this machine must not outlive the session either, and no
    process here holds it: the Slurm jobs of a session (the session writes each job's name as it submits
    it; scancel ends them, where killing their sruns would not)."""
    lines = [line for line in dict.fromkeys(raw.decode().strip() for raw in sys.stdin.buffer) if line]
    for at in range(0, len(lines), AT_ONCE):
        started = []
        for line in lines[at : at + AT_ONCE]:
            try:
                started.append(subprocess.Popen([*command, line], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
            except OSError:
                continue
        for process in started:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()


USAGE = "[--term-first SECONDS] [--env-line] -- command [args...]  |  --for-each-line '[\"command\", ...]'"


def read_env_line() -> dict[str, str]:
    """The first line of stdin, a JSON object of variables for the command: what the command must have
    and no command line may show (a worker's keys), sent by the session over ssh. Read byte by byte, so
    that the rest of stdin stays the lifeline's."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(sys.stdin.fileno(), 1)
        if not byte:
            sys.exit("the session ended before it sent the command's environment")
        line += byte
    variables = json.loads(line)
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        sys.exit("--env-line: the first line of stdin must be a JSON object of strings")
    return variables


def main() -> None:
    argv = sys.argv[1:]
    term_first = 0.0
    if argv[:1] == ["--for-each-line"] and len(argv) == 2:
        for_each_line(json.loads(argv[1]))
        return
    if argv[:1] == ["--term-first"] and len(argv) > 1:
        term_first, argv = float(argv[1]), argv[2:]
    env = None
    if argv[:1] == ["--env-line"]:
        env, argv = {**os.environ, **read_env_line()}, argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit(f"usage: python {__file__} {USAGE}")
    # Killing the command may not end what it started beyond this machine: --term-first TERMs the command
    # and gives it that long (srun sent TERM cancels its step of an allocation).
    started: list[subprocess.Popen[bytes]] = []
    if term_first:
        hold(lambda: _terminate(started, term_first))
    else:
        hold()
    # In this process group, so that stopping the group (or the session dying) ends it too.
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
    started.append(child)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    code = child.wait()
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
