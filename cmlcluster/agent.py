"""The agent: what runs inside every worker.

It prepares the worker's environment, connects an ipyparallel engine to the
session's controller, and then serves: the session runs the worker's program
and everything else (%px, TF servers, sshd) through that engine.

The engine's own heartbeat check runs on its event loop, which user code
blocks for as long as it runs. A worker whose session is gone must not train
on for hours, so a watchdog thread listens to the controller's heartbeat pings
(the same ones the engine answers) and ends the worker's whole process group
when they stop.

Started as ``python -m cmlcluster.agent``, configured by environment:
CMLCLUSTER_ENGINE_ID (the engine id to request), CMLCLUSTER_CONNECTION (the
controller's engine connection info, as JSON: data, never a path on the session's
disk; removed from the environment before any user code runs), CDSW_MASTER_IP
(the controller's address), CMLCLUSTER_PRELOAD (modules to import while the engine
registers, comma-separated; optional).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ipyparallel.engine.app import IPEngine
from IPython import get_ipython
from traitlets import default

from . import control, shipping
from .ports import route_address

# The controller pings every control.HEARTBEAT_MS; silent this long and the session is
# taken to be gone.
SESSION_SILENCE_SECONDS = 5.0
# The session starts its controller and its first workers at once: an engine may wait for the
# controller to listen for as long as the session waits for it.
REGISTRATION_TIMEOUT_SECONDS = control.CONTROLLER_START_TIMEOUT
PROXY_VARIABLES = ("http_proxy", "https_proxy", "no_proxy", "all_proxy", "grpc_proxy")

log = logging.getLogger("cmlcluster.agent")


def clean_environment(environ: dict[str, str] | Any = os.environ) -> None:
    """Drop variables that break workers.

    Empty proxy variables make gRPC (TensorFlow) fail to connect. PYTEST_CURRENT_TEST,
    inherited from a test session, turns off ipykernel's capture of fd-level
    output, which would make workers under test behave unlike workers in use.
    """
    for name in list(environ):
        if name.lower() in PROXY_VARIABLES and not environ[name].strip():
            del environ[name]
    environ.pop("PYTEST_CURRENT_TEST", None)


def describe() -> dict[str, Any]:
    """What the session learns about a worker once its engine has registered."""
    return {
        "worker_id": os.environ.get("CDSW_ENGINE_ID"),
        "ip_address": os.environ.get("CDSW_IP_ADDRESS"),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }


_files_folder: str | None = None  # where shipped files were unpacked; relative scripts are found there


def unpack_files(archive: bytes, in_cwd: bool = False) -> str:
    """Unpack files shipped by the session; return the folder they are in.

    Into the working folder when it is the worker's own (in_cwd), else into a private
    folder in the worker's temp folder, so that nothing shipped overwrites a shared folder.
    """
    global _files_folder
    if in_cwd:
        _files_folder = os.getcwd()
    return shipping.unpack(archive, files_folder())


def files_folder() -> str:
    """The folder shipped files go to in this worker (made on first use)."""
    global _files_folder
    if _files_folder is None:
        _files_folder = tempfile.mkdtemp(prefix="cmlcluster-files-")
    return _files_folder


def script_path(script: str) -> str:
    """Where a script named by the session is in this worker: shipped ones are relative names."""
    if os.path.isabs(script):
        return script
    return os.path.join(_files_folder or os.getcwd(), script)


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
        return -e.signal
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        _program_running = False
        sys.stdout.flush()
        sys.stderr.flush()
        _in_program = False
    return 0


def run_cell(code: str) -> int:
    """Run `code` as CML's engine, an IPython kernel, runs a cell; return its exit code.

    Notebooks pass code as an indented triple-quoted string, with `!cmd` and `%magic` lines. A cell
    that is one `!cmd` exits with the command's exit code, as ``sh -c cmd``; a `!cmd` among other
    lines only sets ``_exit_code``, as in IPython. Runs in a namespace of its own, as ``__main__``.
    """
    source = cell_source(code)
    compiled = compile(source, "<worker code>", "exec")
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


_program_running = False  # whether run_program runs the worker's program now (until a stop interrupts it)
_in_program = False  # whether run_program has yet to return: the program, or its cleanup after a stop


class ProgramStopped(BaseException):
    """Raised in the worker's program by the stop signal's handler, which runs in it."""

    def __init__(self, signal: int):
        super().__init__(f"stopped by signal {signal}")
        self.signal = signal


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


def _watch_controller(ping_url: str, period_ms: int, curve: dict[int, bytes]) -> None:
    import zmq

    context = zmq.Context()
    pings = context.socket(zmq.SUB)
    for option, value in curve.items():
        pings.setsockopt(option, value)
    pings.setsockopt(zmq.SUBSCRIBE, b"")
    pings.connect(ping_url)
    allowed = SESSION_SILENCE_SECONDS
    # Silence is counted in empty polls as well as in seconds: a process (or a whole machine)
    # frozen for longer than `allowed` wakes to a clock that jumped, before the pings sent
    # meanwhile have been read; one empty poll then must not end a live session's worker.
    empty_polls_needed = max(1, round(allowed * 1000 / period_ms))
    last, empty_polls = time.monotonic(), 0
    while True:
        if pings.poll(period_ms):
            pings.recv()
            last, empty_polls = time.monotonic(), 0
            continue
        empty_polls += 1
        if empty_polls >= empty_polls_needed and time.monotonic() - last > allowed:
            break
    os.write(
        _stderr,
        f"cmlcluster agent: no heartbeat from the controller for {allowed:g} s; "
        "the session is gone, exiting\n".encode(),
    )
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)  # the user's child processes go too
    os._exit(70)


class AgentEngine(IPEngine):
    """An ipyparallel engine whose controller watch does not depend on its event loop."""

    stop_signal: int | None = None  # the signal that stopped it (the backend's stop), if one did

    def _signal_stop(self, sig: int, frame: Any) -> None:
        global _program_running
        AgentEngine.stop_signal = sig
        super()._signal_stop(sig, frame)
        if _program_running:
            # The engine stops once the program returns: end it now (its finally blocks run), not
            # when the backend's grace runs out and the worker is killed. Once: a second signal
            # must not interrupt the program's cleanup.
            _program_running = False
            raise ProgramStopped(sig)

    def restore_output(self) -> None:
        # ipyparallel's stop points sys.stdout/err back at the process's own as the engine shuts down.
        # A program the stop interrupts runs its cleanup after that (its finally blocks): what it
        # prints then must reach the session like all it printed before, not only the worker's log
        # (where it also lost the race with the agent's end: the fd copier is a thread).
        if not _in_program:
            super().restore_output()

    def start(self) -> None:
        try:
            super().start()
        finally:
            if AgentEngine.stop_signal is not None:
                self._send_what_is_queued()

    def _send_what_is_queued(self) -> None:
        """Before the agent dies of a stop's signal, what its engine holds leaves for the controller:
        the program's last output and idle status (the IOPub thread's) and its reply, left queued on
        the shell stream when the stop stopped the engine's loop (lost in about 1 stop of 3 before).
        The session reports a stopped worker's end once these are in."""
        import zmq
        from ipykernel.iostream import IOPubThread

        kernel = getattr(self, "kernel", None)
        if kernel is None:  # stopped before it registered: nothing was asked of it
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            kernel.shell_stream.flush(zmq.POLLOUT)
        if isinstance(kernel.iopub_socket, IOPubThread):
            with contextlib.suppress(Exception):
                kernel.iopub_socket.stop()  # sends what it holds, then ends

    @default("connection_info_env")
    def _connection_from_session(self) -> str:
        return _connection

    def start_heartbeat(self, hb_ping: str, hb_pong: str, hb_period: int, identity: bytes) -> None:
        super().start_heartbeat(hb_ping, hb_pong, hb_period, identity)
        import zmq

        curve: dict[int, bytes] = {}
        if self.curve_serverkey:
            curve = {
                zmq.CURVE_SERVERKEY: self.curve_serverkey,
                zmq.CURVE_PUBLICKEY: self.curve_publickey,
                zmq.CURVE_SECRETKEY: self.curve_secretkey,
            }
        threading.Thread(
            target=_watch_controller, args=(hb_ping, hb_period, curve), name="controller-watch", daemon=True
        ).start()


_connection = ""  # the controller's connection info (JSON), kept out of the environment user code sees
# The worker's own stderr (its log), kept before the engine points fd 2 at a pipe to the session:
# the watchdog's last words go there, not into a pipe whose reader dies with the process.
_stderr = 2


def import_kernel_without_debugger() -> None:
    """Import ipykernel's debugger module with debugpy hidden, so that it records debugpy as absent.

    An engine has no debugger channel (ipykernel: "debugpy_stream undefined, debugging will not be
    enabled"), yet creating its kernel imports debugpy: 0.15 to 0.25 s of CPU in every worker's
    start. User code can still import debugpy: only this module's record of it is kept.
    """
    hidden = "debugpy" not in sys.modules
    if hidden:
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # makes `import debugpy` fail
    try:
        import ipykernel.debugger  # noqa: F401
    finally:
        if hidden:
            del sys.modules["debugpy"]


def _preload(modules: list[str]) -> None:
    """Import what the worker will be asked to use (CMLCLUSTER_PRELOAD, e.g. start_cluster's
    tensorflow) while the engine registers, instead of after: one TensorFlow worker's call ->
    ready went from 4.93 to 4.39 s (by hand 3.63 s). A module that fails is left to the call
    that needs it, which says why."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S112
            continue


def session_connection() -> str:
    """The controller's connection info: from CMLCLUSTER_CONNECTION, or from the file that
    CMLCLUSTER_CONNECTION_FILE names (a pod's mounted Secret: a pod's env is readable by whoever
    may read the pod). The key is cmlcluster's, not the program's: no child process inherits it."""
    path = os.environ.pop(control.CONNECTION_FILE_ENV, "")
    connection = os.environ.pop(control.CONNECTION_ENV, "")
    if not path:
        if not connection:
            raise SystemExit(
                f"cmlcluster agent: neither {control.CONNECTION_ENV} nor {control.CONNECTION_FILE_ENV} is set; "
                "workers are started by a session (launch_workers), not by hand"
            )
        return connection
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise SystemExit(
            f"cmlcluster agent: cannot read the controller's connection info from {path} ({e}); it is mounted "
            f"for the pod's user only (mode 0400): run the worker image as the user that owns it (root)"
        ) from None


def main() -> None:
    global _connection, _stderr
    _stderr = os.dup(2)  # not inherited by user code's processes (Python's fds are non-inheritable)
    clean_environment()
    import_kernel_without_debugger()
    preload = os.environ.pop("CMLCLUSTER_PRELOAD", "")
    if preload:
        threading.Thread(target=_preload, args=(preload.split(","),), name="preload", daemon=True).start()
    _connection = session_connection()
    engine_id = os.environ["CMLCLUSTER_ENGINE_ID"]
    master = os.environ["CDSW_MASTER_IP"]
    os.environ["CDSW_IP_ADDRESS"] = route_address(master)
    engine = AgentEngine.instance()
    engine.initialize(
        [
            f"--IPEngine.id={engine_id}",
            # Its default is the folder the engine's module was imported in, a template's for a
            # forked worker (local_template.py).
            f"--IPEngine.work_dir={os.getcwd()}",
            # The agent is the worker's supervisor; ipyparallel's nanny process would
            # only add a second process per worker outside its process group.
            "--IPEngine.enable_nanny=False",
            # Replaced by _watch_controller, which works while user code runs.
            "--IPEngine.max_heartbeat_misses=0",
            f"--IPEngine.timeout={REGISTRATION_TIMEOUT_SECONDS:g}",
            f"--log-level={os.environ.get('CMLCLUSTER_LOG_LEVEL', 'WARN')}",
        ]
    )
    try:
        engine.start()
    except RuntimeError:
        # A stop signal stops the engine's loop, and tornado's run_sync then raises "Event loop
        # stopped before Future completed", which IPEngine.start lets through: exit code 1 and a
        # traceback for a worker that was only asked to stop.
        if AgentEngine.stop_signal is None:
            raise
    if AgentEngine.stop_signal is not None:
        # Die of the signal, as the backend's contract reports a stop (-15), not as a failure.
        signal.signal(AgentEngine.stop_signal, signal.SIG_DFL)
        os.kill(os.getpid(), AgentEngine.stop_signal)


def run_as_process() -> None:
    """`python -m cmlcluster.agent`: a worker's agent, or, with --template, a local backend's template."""
    from .backends.local_template import TEMPLATE_FLAG, main_of_child

    if sys.argv[1:] == [TEMPLATE_FLAG]:
        import_kernel_without_debugger()  # once, for every worker the template forks
        main_of_child()  # returns in each worker the template forks: the local backend's workers
    main()


if __name__ == "__main__":
    # As the package's module, not as __main__: the session's calls (run_program, unpack_files) import
    # cmlcluster.agent, whose state (the program running, the shipped files) must be the engine's.
    from cmlcluster.agent import run_as_process as run

    run()
