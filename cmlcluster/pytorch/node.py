"""One node of a PyTorch run: torchrun on a worker. Called by the session through the agent.

run() starts ``python -m cmlcluster.pytorch.launch`` (torchrun, see launch.py) under a
lifeline, so that it dies with the worker however the worker ends; relays every line of its
output as it comes, a process's lines as ``[rank r] text``; and returns what happened. The
processes themselves die with torchrun (see rank.py). A static run's node has its node rank; an
elastic run's node (plan["endpoint"]: the session's rendezvous store) learns its ranks each round.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, Any

from .. import _lifeline
from .._proc import python_module
from ..agent import files as agent_files
from ..lines import MAX_LINE_CHARS
from . import commands

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py")  # what every process runs
RANKS_STOP_GRACE = 1.0  # seconds the ranks have after their worker's stop (TERM) before torchrun is KILLed


def run(plan: dict[str, Any]) -> dict[str, Any]:
    """Run this node's torchrun to the end; {"exit_code", "failures" (first first), "error" (the rendezvous
    not reached), "value" (rank 0's, pickled)}.

    plan: nnodes, nproc_per_node, join_timeout, threads, dist_backend, rank0_only; either node_rank,
    master_addr and master_port (static), or endpoint, run_id, rdzv_key, local_addr and max_restarts (elastic);
    and either script and args, or call (a pickled (fn, args, kwargs)).
    """
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError(
            f"PyTorch is not installed in this worker's Python ({sys.executable}); install torch in the "
            "workers' image or environment (pip install torch)"
        )
    folder = tempfile.mkdtemp(prefix="cmlcluster-torch-")
    try:
        report = os.path.join(folder, "report.json")
        result = os.path.join(folder, "value.pickle")
        if plan.get("call"):
            call_file = os.path.join(folder, "call.pickle")
            with open(call_file, "wb") as f:
                f.write(plan["call"])
            entry = [RANK, "--function", call_file, result]
        else:
            entry = [RANK, agent_files.script_path(plan["script"]), *plan["args"]]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(plan["threads"]))  # torchrun would say 1
        env["CMLCLUSTER_DIST_BACKEND"] = plan["dist_backend"]
        # The node's own folder for snapshots: kept while this node runs, across restarts of its processes.
        env["CMLCLUSTER_CHECKPOINT_DIR"] = os.path.join(folder, "checkpoints")
        env["PYTHONUNBUFFERED"] = "1"
        if plan.get("node_rank") is None:
            # Each round's process-group store at that round's rank 0, not at the first round's
            # (a node that may be gone): pytorch/pytorch#135712, #167302.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # The run id and the state's signing key: in torchrun's environment, readable by this user
            # alone, never on a command line (launch.py takes the key out before the ranks start).
            env.update(commands.elastic_env(plan["run_id"], plan["rdzv_key"]))
        # torchrun's agent imports nothing of the worker's folder (the ranks do, as a script does).
        torchrun = python_module("cmlcluster.pytorch.launch", report, *_torchrun_args(plan, folder, entry))
        process = subprocess.Popen(
            [sys.executable, _lifeline.__file__, "--", *torchrun],
            env=env,
            stdin=subprocess.PIPE,  # the lifeline: torchrun dies with this worker
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            with _stops_reach(process):
                _relay(process, plan.get("node_rank"), plan["nproc_per_node"], plan["rank0_only"])
                code = process.wait()
        finally:
            assert process.stdin is not None
            process.stdin.close()
        reported: dict[str, Any] = {}
        if os.path.exists(report):
            with open(report) as f:
                reported = json.load(f)
        value = b""
        if code == 0 and os.path.exists(result):
            with open(result, "rb") as f:
                value = f.read()
        return {
            "exit_code": code,
            "failures": reported.get("failures", []),
            "error": reported.get("error", ""),
            "value": value,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _torchrun_args(plan: dict[str, Any], folder: str, entry: list[str]) -> list[str]:
    """launch.py's arguments after REPORT: [the rendezvous to wait for] -- torchrun's arguments."""
    if plan.get("node_rank") is None:  # elastic: the session's store runs already
        return [
            "--",
            *commands.elastic_torchrun_args(
                nnodes=plan["nnodes"],
                nproc_per_node=plan["nproc_per_node"],
                endpoint=plan["endpoint"],
                local_addr=plan["local_addr"],
                max_restarts=plan["max_restarts"],
                join_timeout=plan["join_timeout"],
                log_dir=os.path.join(folder, "logs"),
                entry=entry,
            ),
        ]
    master = f"{plan['master_addr']}:{plan['master_port']}"
    return [
        *([] if plan["node_rank"] == 0 else [master, str(plan["join_timeout"])]),
        "--",
        *commands.torchrun_args(
            nnodes=plan["nnodes"],
            node_rank=plan["node_rank"],
            nproc_per_node=plan["nproc_per_node"],
            master_addr=plan["master_addr"],
            master_port=plan["master_port"],
            join_timeout=plan["join_timeout"],
            log_dir=os.path.join(folder, "logs"),
            entry=entry,
        ),
    ]


@contextlib.contextmanager
def _stops_reach(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """A stop of this worker (SIGTERM to its agent) reaches torchrun at once: the agent ends a running
    program on it, but this is a call, which it leaves to run (here, until torchrun ends) until the
    KILL after the backend's grace. The lifeline passes the TERM to torchrun, torchrun to the ranks;
    torchrun itself then takes seconds to exit (torch's teardown), so its lifeline is cut a moment later."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers are the main thread's
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(sig: int, frame: Any) -> None:
        process.terminate()
        assert process.stdin is not None
        cut = threading.Timer(RANKS_STOP_GRACE, process.stdin.close)  # EOF: the lifeline KILLs torchrun
        cut.daemon = True
        cut.start()
        if callable(previous):
            previous(sig, frame)  # the agent's own: its engine stops once this call returns

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _relay(process: subprocess.Popen[bytes], node_rank: int | None, nproc: int, rank0_only: bool) -> None:
    """Print torchrun's output line by line as it comes (the engine streams it to the session)."""
    assert process.stdout is not None and process.stderr is not None
    targets: dict[IO[bytes], Any] = {process.stdout: sys.stdout, process.stderr: sys.stderr}
    partial: dict[IO[bytes], bytes] = {pipe: b"" for pipe in targets}
    teed = {pipe: commands.TeedLines(node_rank, nproc) for pipe in targets}
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
                labelled = [line for raw in lines for line in teed[pipe].feed(raw.decode(errors="replace"))]
                if not chunk:
                    labelled += teed[pipe].flush()
                for rank, text in labelled:
                    if rank is None:
                        print(text, file=targets[pipe])
                    elif rank == 0 or not rank0_only:
                        print(f"[rank {rank}] {text}", file=targets[pipe])
                targets[pipe].flush()
