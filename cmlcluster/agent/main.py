"""The agent: what runs inside every worker, started as ``python -m cmlcluster.agent``.

It prepares the worker's environment, connects an ipyparallel engine (agent_engine) to the
session's controller, and then serves: the session runs the worker's program (agent_program)
and everything else (%px, TF servers, sshd) through that engine, calling this module's
functions by name: `describe`, `run_program`, `call` (control._agent_call), `unpack_files` and
`leftovers` ("cmlcluster.agent.main:unpack_files"; agent_files), and hands collect= files over through
agent_results (imported only when the session asks). An interrupt request on the engine's control
channel ends the running program as a stop does, but leaves the engine serving (agent_engine).

Configured by environment:
CMLCLUSTER_ENGINE_ID (the engine id to request), CMLCLUSTER_CONNECTION (the controller's engine connection
info, as JSON: data, never a path on the session's disk; removed from the environment before any user code
runs), CDSW_MASTER_IP (the controller's address), CMLCLUSTER_PRELOAD (modules to import while the engine
registers, comma-separated; optional), CMLCLUSTER_SILENCE_TIMEOUT (the session's silence_timeout: seconds
without the controller's pings before the worker ends; agent_engine), CMLCLUSTER_LIFELINE_FD (on the session's
machine: a pipe that reads end-of-file when the session's process ends; agent_engine), CMLCLUSTER_OWN_FOLDER
("1": the working folder is the worker's own, removed with it; agent_files.leftovers), CMLCLUSTER_COLLECT (its
collect= paths, as JSON: they come home, so they are not said to be left behind), CMLCLUSTER_USAGE_SECONDS
(how often it samples what the worker uses, 2 s by default, 0 for never; usage.py),
CMLCLUSTER_APP_FORWARD_PORT (where its address is not the session machine's loopback: the port on it that
relays to its CDSW_APP_PORT; apps/forward.py).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from .. import _redact, wire
from ..control import ipyparallel_internals
from ..errors import ControllerError
from ..ports import route_address
from . import engine_imports
from . import files as agent_files
from .engine import AgentEngine, import_kernel_without_debugger, silence_seconds, watch_lifeline
from .files import leftovers, unpack_files
from .program import call, run_program

# What the session calls in a worker by name, with describe (defined here).
__all__ = ["call", "describe", "leftovers", "run_program", "unpack_files"]

REGISTRATION_TIMEOUT_SECONDS = wire.CONTROLLER_START_TIMEOUT
PROXY_VARIABLES = ("http_proxy", "https_proxy", "no_proxy", "all_proxy", "grpc_proxy")

log = logging.getLogger(__name__)


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
    path = os.environ.pop(wire.CONNECTION_FILE_ENV, "")
    connection = os.environ.pop(wire.CONNECTION_ENV, "")
    if not path:
        if not connection:
            raise SystemExit(
                f"cmlcluster agent: neither {wire.CONNECTION_ENV} nor {wire.CONNECTION_FILE_ENV} is set; "
                "workers are started by a session (launch_workers), not by hand"
            )
        return connection
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise SystemExit(
            f"cmlcluster agent: cannot read the controller's connection info from {path} ({e}); only the "
            "worker's user (and, in a pod, its fsGroup) may read it: run the worker as that user"
        ) from None


def main() -> None:
    AgentEngine.log_fd = os.dup(2)  # not inherited by user code's processes (Python's fds are non-inheritable)
    lifeline = os.environ.pop(wire.LIFELINE_FD_ENV, "")
    if lifeline:  # first: a session that dies while the engine registers takes the worker with it too
        os.set_inheritable(int(lifeline), False)  # the agent's, not its programs'
        threading.Thread(
            target=watch_lifeline, args=(int(lifeline), AgentEngine.log_fd), name="lifeline", daemon=True
        ).start()
    clean_environment()
    # A scheduler's warning before a time limit (Slurm's --signal=USR1@seconds reaches every process of the
    # job) is for the program, which installs its own handler: it never ends the worker. A Python handler,
    # not SIG_IGN, which the program's own processes would inherit.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        ipyparallel_internals.probe_engine()
    except ControllerError as e:  # into the worker's log, which the session quotes when the worker ends
        print(f"cmlcluster agent: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    import_kernel_without_debugger()
    engine_imports.replies_import_only_what_is_imported()
    agent_files.own_folder = os.getcwd() if os.environ.pop(wire.OWN_FOLDER_ENV, "") == "1" else ""
    agent_files.collected = tuple(json.loads(os.environ.pop(wire.COLLECT_ENV, "[]")))
    agent_files.started = time.time()
    preload = os.environ.pop(wire.PRELOAD_ENV, "")
    if preload:
        threading.Thread(target=_preload, args=(preload.split(","),), name="preload", daemon=True).start()
    AgentEngine.controller_connection = session_connection()
    # At DEBUG the engine logs its configuration, Session.key included, into the worker's kept log.
    _redact.hide(str(json.loads(AgentEngine.controller_connection).get("key", "")))
    AgentEngine.silence_seconds = silence_seconds(os.environ.pop(wire.SILENCE_ENV, ""))
    engine_id = os.environ[wire.ENGINE_ID_ENV]
    master = os.environ["CDSW_MASTER_IP"]
    os.environ["CDSW_IP_ADDRESS"] = route_address(master)
    AgentEngine.app_forward_port = os.environ.pop(wire.APP_FORWARD_PORT_ENV, "")  # apps/forward.py
    engine = AgentEngine.instance()
    engine.initialize(
        [
            f"--IPEngine.id={engine_id}",
            # Its default is the folder the engine's module was imported in, a template's for a
            # forked worker (agent/template.py).
            f"--IPEngine.work_dir={os.getcwd()}",
            # The agent is the worker's supervisor; ipyparallel's nanny process would
            # only add a second process per worker outside its process group.
            "--IPEngine.enable_nanny=False",
            # Replaced by agent_engine's controller watch, which works while user code runs.
            "--IPEngine.max_heartbeat_misses=0",
            f"--IPEngine.timeout={REGISTRATION_TIMEOUT_SECONDS:g}",
            f"--log-level={os.environ.get(wire.LOG_LEVEL_ENV, 'WARN')}",
        ]
    )
    _redact.hide(engine.curve_secretkey)  # its own CurveZMQ key pair's secret half, made as it initialized
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
    from .template import TEMPLATE_FLAG, main_of_child

    if sys.argv[1:] == [TEMPLATE_FLAG]:
        import_kernel_without_debugger()  # once, for every worker the template forks
        main_of_child()  # returns in each worker the template forks: the local backend's workers
    main()
