"""Local workers forked from a template agent, which has imported the agent's modules once.

Every worker runs an ipyparallel engine, and importing it (ipyparallel, ipykernel,
IPython, zmq, tornado) costs about 0.3 s of CPU, the largest part of a worker's own
start. On a machine whose cores the workers' start keeps busy (six TensorFlow workers
on two cores), that is what a cluster's call -> ready waits for. So the local backend
starts, per session and environment, one template: ``python -m cmlcluster.agent
--template``, stopped before the agent's main(). It forks a worker for each request;
the child leaves the template's loop and runs main() as an agent started on its own
would, in its own session, folder, environment and log.

A fork keeps what the template read of its environment when it started (the
interpreter's PYTHON* variables, the loader's LD_*, anything an import read), so a
template serves the workers whose environment is its own but for each worker's own
variables (ids, GPUs, temp folder); workers of another environment get another
template. The environment ``/proc/<pid>/environ`` shows is the one a process started
with: for a forked worker, the template's, without the worker's own variables.
Workers are started on their own where fork is not available, or past MAX_TEMPLATES.

The template is single-threaded (fork and threads do not mix): one loop reads
requests on stdin, a JSON line each, forks, and writes on stdout the child's pid
and, when a child ends, its exit code, which only the parent can read. Its stdin is
its lifeline: when the session closes it, or dies, the template exits. Its workers
hold the session's own lifeline (wire.LIFELINE_FD_ENV), as workers started on their
own do, and end with the session's process; a template that dies while the session
lives has its workers killed by the session (nothing could read their exit codes).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import selectors
import signal
import sys
import tempfile
from collections import deque
from collections.abc import Mapping
from typing import Any

from .. import _lifeline, wire
from ..errors import BackendError
from ..workers import PACKAGE_PARENT, WorkerSpec

TEMPLATE_FLAG = "--template"
AGENT_MODULE = "cmlcluster.agent"
MAX_TEMPLATES = 4  # environments per session: each template is a process as long as the session lives
# Imported by an engine as it starts (its shell's history database, completer and inspector, tornado's
# asyncio loop, the IDNA codec of getaddrinfo) or soon after (psutil, by its resource sampler: usage.py),
# so imported once by the template too. Not numpy, which a worker imports only if its program does
# (agent/engine_imports.py): its OpenBLAS starts threads as it loads.
WARM_MODULES = (
    "IPython.core.completerlib",
    "IPython.core.oinspect",
    "IPython.extensions.storemagic",
    "encodings.idna",
    "sqlite3",
    "tornado.platform.asyncio",
    "psutil",
)
# A worker's own variables, never in a template's environment: ids, its GPUs, its temp folder, its
# web-app ports, what it imports early, and the controller's key, which the agent takes out of its
# environment.
OWN_VARIABLES = frozenset(
    {
        "CDSW_ENGINE_ID",
        wire.ENGINE_ID_ENV,
        "CUDA_VISIBLE_DEVICES",
        "TMPDIR",
        *wire.APP_PORT_ENVS,
        wire.PRELOAD_ENV,
        wire.CONNECTION_ENV,
        wire.CONNECTION_FILE_ENV,
    }
)


def shared_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What a template started for a worker with this environment has: all but the worker's own."""
    return {k: v for k, v in env.items() if k not in OWN_VARIABLES}


def can_fork(spec: WorkerSpec, env: Mapping[str, str]) -> bool:
    """Whether this worker can be forked from a template: an agent of this interpreter, on Linux, with
    the session's own start-up variables. A launch's env= that changes how Python starts (its
    PYTHONPATH's sitecustomize, say) is for each worker's start, not once for a template's."""
    return (
        sys.platform == "linux"
        and tuple(spec.argv) == (sys.executable, "-m", AGENT_MODULE)
        and _startup_variables(env) == _startup_variables(os.environ)
    )


def _startup_variables(env: Mapping[str, str]) -> dict[str, str]:
    """What the interpreter and the dynamic loader read when a process starts, but what every local
    worker gets (this cmlcluster's folder on its PYTHONPATH, unbuffered output)."""
    found = {k: v for k, v in env.items() if k.startswith(("PYTHON", "LD_")) and k != "PYTHONUNBUFFERED"}
    path = [p for p in found.pop("PYTHONPATH", "").split(os.pathsep) if p and p != PACKAGE_PARENT]
    if path:
        found["PYTHONPATH"] = os.pathsep.join(path)
    return found


# --- in the template process ----------------------------------------------------------------------


def serve() -> None:
    """The template's loop; returns only in a forked child, ready to run the agent's main()."""
    for name in WARM_MODULES:
        with contextlib.suppress(ImportError):  # another version of them may not have it
            importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:  # a start-up hook (sitecustomize, a .pth file) started them
        _reply({"error": f"the template runs {threads} threads after its start, and fork copies only one"})
        sys.exit(1)
    global _reply_fd
    _reply_fd = os.dup(1)
    os.dup2(2, 1)  # what anything else prints goes to the template's log, not into its replies
    wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes the wakeup fd
    requests = os.fdopen(sys.stdin.fileno(), "rb", buffering=0, closefd=False)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "request")
    selector.register(wakeup_read, selectors.EVENT_READ, "child")
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wakeup_read, 4096)
                _report_exits()
                continue
            data = requests.read(65536)
            if not data:  # the session closed its end, or died
                sys.exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    output = _open_output(request["output"])
                except OSError as e:
                    _reply({"error": f"cannot open the worker's output pipe: {e}"})
                    continue
                try:
                    pid = os.fork()
                except OSError as e:
                    os.close(output)
                    _reply({"error": f"fork failed: {e}"})
                    continue
                if pid == 0:
                    selector.close()
                    for fd in (wakeup_read, wakeup_write):
                        os.close(fd)
                    _become_worker(request, output)
                    return
                os.close(output)  # the child holds it: the session sees the pipe's end when the worker's goes
                _reply({"pid": pid})


def _open_output(path: str) -> int:
    """The writing end of the FIFO the session copies a worker's output from (logfile.WorkerOutput).
    Opened without waiting (a FIFO that no one reads fails at once, never hangs the template), then
    made to block: a worker whose reader is slow waits for it and loses nothing."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(fd, True)
    return fd


def _report_exits() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


_reply_fd = 1  # the template's stdout, a pipe the session reads


def _reply(message: dict[str, Any]) -> None:
    os.write(_reply_fd, json.dumps(message).encode() + b"\n")


def _become_worker(request: dict[str, Any], output: int) -> None:
    """In the forked child: what start_new_session, cwd, env and the output's redirection give an
    agent started on its own."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    lifeline = request["env"].get(wire.LIFELINE_FD_ENV, "")
    for fd in os.listdir("/proc/self/fd"):  # the template's pipes to the session among them
        if int(fd) > 2 and fd != lifeline:
            with contextlib.suppress(OSError):
                os.close(int(fd))
    template_cwd = os.getcwd()
    os.chdir(request["cwd"])
    # `python -m` puts its start folder first on sys.path.
    if sys.path and sys.path[0] == template_cwd:
        sys.path[0] = request["cwd"]
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read from TMPDIR again: the template's imports may have read it


def main_of_child() -> None:
    """Called by the agent's __main__ with --template."""
    serve()
    sys.argv = sys.argv[:1]


# --- in the session ---------------------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by a template: what LocalBackend uses of an asyncio subprocess."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = asyncio.get_running_loop().create_future()

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)


class Template:
    """One template process and the workers it forked."""

    def __init__(self, env: Mapping[str, str], log_path: str, pass_fds: tuple[int, ...] = ()):
        self._env = dict(env)
        self._pass_fds = pass_fds  # what its workers inherit from it: the session's lifeline
        self._log_path = log_path  # its own output: what a start-up hook or a failed import says
        self._process: asyncio.subprocess.Process | None = None
        self._replies: deque[asyncio.Future[ForkedProcess]] = deque()
        self._children: dict[int, ForkedProcess] = {}
        self._reader: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()

    async def fork(self, env: Mapping[str, str], cwd: str, output: str) -> ForkedProcess:
        """A worker forked with this environment and folder, its stdout and stderr the FIFO `output`."""
        async with self._starting:
            if self._process is None:
                await self._start()
        assert self._process is not None and self._process.stdin is not None
        if self._reader is None or self._reader.done():
            raise BackendError("the local worker template has exited")
        reply: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._replies.append(reply)
        try:
            self._process.stdin.write(json.dumps({"env": dict(env), "cwd": cwd, "output": output}).encode() + b"\n")
            await self._process.stdin.drain()
        except ConnectionError:
            pass  # it has exited: its reader answers the request with why
        try:
            return await asyncio.shield(reply)
        except asyncio.CancelledError:  # the start was abandoned: the worker must not run unowned
            reply.add_done_callback(_kill_if_forked)
            raise

    async def _start(self) -> None:
        with open(self._log_path, "wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                AGENT_MODULE,
                TEMPLATE_FLAG,
                env=self._env,
                cwd="/",
                stdin=asyncio.subprocess.PIPE,  # its lifeline, and the requests
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # the notebook's Ctrl-C is not for it
                pass_fds=self._pass_fds,
            )
        _lifeline.guard_stdin(self._process)
        self._reader = asyncio.get_running_loop().create_task(self._read(self._process))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # printed by an import before the template's loop took its stdout
            if "exited" in message:
                child = self._children.pop(message["exited"], None)
                if child is not None:
                    child._end(message["code"])
            elif self._replies:
                reply = self._replies.popleft()
                if "error" in message:
                    reply.set_exception(BackendError(f"the local worker template could not fork: {message['error']}"))
                else:
                    # Known before the fork() that asked for it resumes: its exit may be the next line.
                    child = self._children[message["pid"]] = ForkedProcess(message["pid"])
                    reply.set_result(child)
        await process.wait()
        # Gone before the session closed it: nothing can read its workers' exit codes any more,
        # and nothing supervises them. They end now, as killed.
        while self._replies:
            self._replies.popleft().set_exception(
                BackendError(f"the local worker template exited with code {process.returncode}")
            )
        for pid, child in self._children.items():
            _kill_group(pid)
            child._end(-signal.SIGKILL)
        self._children.clear()

    async def close(self) -> None:
        if self._process is None:
            return
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            await asyncio.wait_for(self._process.wait(), 5)
        except asyncio.TimeoutError:
            self._process.kill()
            await self._process.wait()
        if self._reader is not None:
            await self._reader


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # a forked worker leads its process group


def _kill_if_forked(reply: asyncio.Future[ForkedProcess]) -> None:
    if reply.exception() is None:
        _kill_group(reply.result().pid)
