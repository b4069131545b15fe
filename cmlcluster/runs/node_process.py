"""A node's launcher on its worker, for every framework of one node per worker: started under a
lifeline, stopped with its worker, and its output relayed line by line, each process's line as
``[rank r] text``. Runs in the worker's agent; imports nothing of the session's side.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any, Protocol

from .. import _lifeline
from ..agent import files as agent_files
from ..lines import MAX_LINE_CHARS

RANKS_STOP_GRACE = 1.0  # seconds the ranks have after their worker's stop (TERM) before the launcher is KILLed


class NodeFolder:
    """A node's private folder while it runs: its function's call, the failure report its launcher writes
    (REPORT: {"failures": [...], "error": ...}) and rank 0's value; removed when the node ends."""

    def __init__(self, framework: str):
        self.path = tempfile.mkdtemp(prefix=f"cmlcluster-{framework}-")
        self.report = os.path.join(self.path, "report.json")
        self.value = os.path.join(self.path, "value.pickle")

    def entry(self, plan: dict[str, Any]) -> list[str]:
        """What each rank runner is given: the script as shipped and its arguments, or
        ``--function CALL RESULT`` for a function's pickled call (plan["call"])."""
        if not plan["call"]:
            return [agent_files.script_path(plan["script"]), *plan["args"]]
        call = os.path.join(self.path, "call.pickle")
        with open(call, "wb") as f:
            f.write(plan["call"])
        return ["--function", call, self.value]

    def reply(self, exit_code: int) -> dict[str, Any]:
        """What the node tells the session (runs/nodes.py): its exit code, the failures and error its
        launcher reported, and rank 0's pickled value after a success."""
        reported: dict[str, Any] = {}
        if os.path.exists(self.report):
            with open(self.report) as f:
                reported = json.load(f)
        value = b""
        if exit_code == 0 and os.path.exists(self.value):
            with open(self.value, "rb") as f:
                value = f.read()
        failures = reported.get("failures", [])
        return {"exit_code": exit_code, "failures": failures, "error": reported.get("error", ""), "value": value}

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def node_folder(framework: str) -> Iterator[NodeFolder]:
    folder = NodeFolder(framework)
    try:
        yield folder
    finally:
        folder.remove()


class Labeller(Protocol):
    """Whole lines, each with its global rank (None: the launcher's own), from the launcher's output."""

    def feed(self, line: str) -> list[tuple[int | None, str]]: ...

    def flush(self) -> list[tuple[int | None, str]]: ...


class OneRank:
    """Every line is one process's: a launcher that is the process itself (JAX's)."""

    def __init__(self, rank: int):
        self.rank = rank

    def feed(self, line: str) -> list[tuple[int | None, str]]:
        return [(self.rank, line)]

    def flush(self) -> list[tuple[int | None, str]]:
        return []


def run_launcher(
    argv: Sequence[str], env: Mapping[str, str], labeller: Callable[[], Labeller], *, rank0_only: bool = False
) -> int:
    """Run `argv` to its end under a lifeline (it dies with this worker however the worker ends), a stop
    of the worker reaching it at once; print its lines as they come, labelled by a labeller() of each
    pipe; its exit code."""
    process = subprocess.Popen(
        [sys.executable, _lifeline.__file__, "--", *argv],
        env=dict(env),
        stdin=subprocess.PIPE,  # the lifeline: the launcher dies with this worker
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    _lifeline.guard_stdin(process)
    try:
        with _stops_reach(process):
            _relay(process, labeller, rank0_only)
            return process.wait()
    finally:
        assert process.stdin is not None
        process.stdin.close()


@contextlib.contextmanager
def _stops_reach(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """A stop of this worker (SIGTERM to its agent) reaches the launcher at once: the agent ends a running
    program on it, but this is a call, which it leaves to run (here, until the launcher ends) until the
    KILL after the backend's grace. The lifeline passes the TERM to the launcher, and it to the ranks;
    a launcher may take seconds to exit (torch's teardown), so its lifeline is cut a moment later."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers are the main thread's
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(sig: int, frame: Any) -> None:
        process.terminate()
        assert process.stdin is not None
        cut = threading.Timer(RANKS_STOP_GRACE, process.stdin.close)  # EOF: the lifeline KILLs the launcher
        cut.daemon = True
        cut.start()
        if callable(previous):
            previous(sig, frame)  # the agent's own: its engine stops once this call returns

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _relay(process: subprocess.Popen[bytes], labeller: Callable[[], Labeller], rank0_only: bool) -> None:
    """Print the launcher's output line by line as it comes (the engine streams it to the session)."""
    assert process.stdout is not None and process.stderr is not None
    targets: dict[IO[bytes], Any] = {process.stdout: sys.stdout, process.stderr: sys.stderr}
    partial: dict[IO[bytes], bytes] = {pipe: b"" for pipe in targets}
    labellers = {pipe: labeller() for pipe in targets}  # a process's partial line on stdout does not go on in stderr
    with selectors.DefaultSelector() as selector:
        for pipe in targets:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                pipe = process.stdout if key.fileobj is process.stdout else process.stderr
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    selector.unregister(pipe)
                    lines = [partial.pop(pipe)] if partial[pipe] else []
                else:
                    *lines, partial[pipe] = (partial[pipe] + chunk).split(b"\n")
                    if len(partial[pipe]) > MAX_LINE_CHARS:  # a line with no end (a "\r" progress bar): pass it on
                        lines.append(partial[pipe])
                        partial[pipe] = b""
                labelled = [line for raw in lines for line in labellers[pipe].feed(raw.decode(errors="replace"))]
                if not chunk:
                    labelled += labellers[pipe].flush()
                for rank, text in labelled:
                    if rank is None:
                        print(text, file=targets[pipe])
                    elif rank == 0 or not rank0_only:
                        print(f"[rank {rank}] {text}", file=targets[pipe])
                targets[pipe].flush()
