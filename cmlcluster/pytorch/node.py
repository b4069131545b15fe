"""One node of a PyTorch run: torchrun on a worker. Called by the session through the agent.

run() starts ``python -m cmlcluster.pytorch.launch`` (torchrun, see launch.py) under a
lifeline, so that it dies with the worker however the worker ends; relays every line of its
output as it comes, a process's lines as ``[rank r] text``; and returns what happened. The
processes themselves die with torchrun (see rank.py). A static run's node has its node rank; an
elastic run's node (plan["endpoint"]: the session's rendezvous store) learns its ranks each round.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

from .._proc import python_module
from ..runs.node_process import node_folder, run_launcher
from . import commands

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py")  # what every process runs
# What each node runs: torchrun (launch.py), or Accelerate's launch, which runs torchrun (accelerate/launch.py).
LAUNCHERS = {"torch": "cmlcluster.pytorch.launch", "accelerate": "cmlcluster.accelerate.launch"}


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
    with node_folder("torch") as folder:
        entry = [RANK, *folder.entry(plan)]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(plan["threads"]))  # torchrun would say 1
        env["CMLCLUSTER_DIST_BACKEND"] = plan["dist_backend"]
        # The node's own folder for snapshots: kept while this node runs, across restarts of its processes.
        env["CMLCLUSTER_CHECKPOINT_DIR"] = os.path.join(folder.path, "checkpoints")
        env["PYTHONUNBUFFERED"] = "1"
        if plan.get("node_rank") is None:
            # Each round's process-group store at that round's rank 0, not at the first round's
            # (a node that may be gone): pytorch/pytorch#135712, #167302.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # The run id and the state's signing key: in torchrun's environment, readable by this user
            # alone, never on a command line (launch.py takes the key out before the ranks start).
            env.update(commands.elastic_env(plan["run_id"], plan["rdzv_key"]))
        # torchrun's agent imports nothing of the worker's folder (the ranks do, as a script does).
        argv = python_module(
            LAUNCHERS[plan["launcher"]],
            *_launcher_head(plan, folder.report),
            *_torchrun_args(plan, folder.path, entry),
        )
        code = run_launcher(
            argv,
            env,
            lambda: commands.TeedLines(plan.get("node_rank"), plan["nproc_per_node"]),
            rank0_only=plan["rank0_only"],
        )
        return folder.reply(code)


def _launcher_head(plan: dict[str, Any], report: str) -> list[str]:
    """The launcher's first arguments: REPORT, and for Accelerate's, its settings for this node."""
    if plan["launcher"] != "accelerate":
        return [report]
    settings = {
        "launch_args": plan["launch_args"],
        "nnodes": plan["nnodes"],
        "nproc_per_node": plan["nproc_per_node"],
        "node_rank": plan.get("node_rank"),
        "master_addr": plan.get("master_addr") or plan["local_addr"],
        "cpu": plan["dist_backend"] == "gloo",
    }
    return [report, json.dumps(settings)]


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
