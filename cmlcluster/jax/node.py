"""One node of a JAX run: one JAX process on a worker (it uses every device the worker has). Called by
the session through the agent; returns what happened, as every framework's node does (runs/nodes.py).

The process (process.py) runs under a lifeline and stops with its worker (runs/node_process.py);
each of its lines comes back as ``[rank <its process id>] text``. Process 0 hosts JAX's coordinator,
bound to its worker's address alone (JAX would listen on every interface).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from ..runs.node_process import OneRank, node_folder, run_launcher
from .process import REPORT_ENV

PROCESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "process.py")


def run(plan: dict[str, Any]) -> dict[str, Any]:
    """Run this node's JAX process to its end; {"exit_code", "failures", "error", "value"}.

    plan: nnodes, node_rank, master_addr, master_port, threads, gpus; either script and args, or call.
    """
    if importlib.util.find_spec("jax") is None:
        raise RuntimeError(
            f"JAX is not installed in this worker's Python ({sys.executable}); install jax in the workers' "
            "image or environment (pip install 'jax[cpu]', or jax[cuda12] for GPUs)"
        )
    with node_folder("jax") as folder:
        coordinator = f"{plan['master_addr']}:{plan['master_port']}"
        env = {
            **os.environ,
            **process_env(plan["nnodes"], plan["node_rank"], coordinator, cpu=not plan["gpus"]),
            REPORT_ENV: folder.report,
            "PYTHONUNBUFFERED": "1",
        }
        env.setdefault("OMP_NUM_THREADS", str(plan["threads"]))
        argv = [sys.executable, PROCESS, *folder.entry(plan)]
        return folder.reply(run_launcher(argv, env, lambda: OneRank(plan["node_rank"])))


def process_env(nnodes: int, process_id: int, coordinator: str, *, cpu: bool) -> dict[str, str]:
    """A JAX process's variables: Kubeflow's JAX runtime's three, the coordinator's bind address (its
    worker's address, for process 0), and Gloo's collectives where there are no GPUs."""
    env = {
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(nnodes),
        "JAX_PROCESS_ID": str(process_id),
        "JAX_COORDINATOR_BIND_ADDRESS": coordinator,
    }
    if cpu:
        env["CMLCLUSTER_JAX_CPU_COLLECTIVES"] = "gloo"
    return env
