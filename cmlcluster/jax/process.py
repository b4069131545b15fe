"""One process of a JAX run, as its node starts it on a worker, by path (so that no package import
comes first, and this folder is not the user's top-level one):

    python .../cmlcluster/jax/process.py SCRIPT [ARGS...]        runs SCRIPT as ``python SCRIPT ARGS`` would
    python .../cmlcluster/jax/process.py --function CALL RESULT   calls a pickled (fn, args, kwargs)

The node sets what Kubeflow's JAX runtime sets (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID); this process makes them what a plain ``jax.distributed.initialize()`` finds (a JAX
cluster environment of its own, as JAX's for Slurm or Kubernetes), and on CPUs gives JAX Gloo's
collectives across processes (JAX's CPU backend has none by default). A failure is written to the
node's report (CMLCLUSTER_JAX_REPORT) with the user's traceback; process 0 pickles a function's value.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, NoReturn

REPORT_ENV = "CMLCLUSTER_JAX_REPORT"


def register_cluster() -> None:
    """jax.distributed.initialize() without arguments reads this run's variables (JAX's own cluster
    detection: a ClusterEnv subclass registers itself, and is asked before the others)."""
    from jax._src import clusters

    class CmlclusterRun(clusters.ClusterEnv):
        @classmethod
        def is_env_present(cls) -> bool:
            return "JAX_NUM_PROCESSES" in os.environ and "JAX_PROCESS_ID" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None = None) -> str:
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["JAX_PROCESS_ID"])

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return None

    types = clusters.ClusterEnv._cluster_types
    types.insert(0, types.pop(types.index(CmlclusterRun)))  # before the environments JAX knows


def use_cpu_collectives() -> None:
    """Gloo across processes, where the workers have no GPUs (Kubeflow's JAX runtime does the same)."""
    if os.environ.get("CMLCLUSTER_JAX_CPU_COLLECTIVES"):
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def failure(e: BaseException) -> dict[str, Any]:
    """The failure as the session names a failed rank (runs/nodes.py)."""
    rank = int(os.environ.get("JAX_PROCESS_ID", "0"))
    return {
        "rank": rank,
        "local_rank": 0,
        "exit_code": 1,
        "message": "".join(traceback.format_exception_only(e)).strip(),
        "traceback": "".join(traceback.format_exception(e)),
        "timestamp": time.time(),
    }


def main(argv: list[str]) -> NoReturn:
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by path: this package's modules are not the user's top-level ones
    from cmlcluster._exit import exit_now, status_of
    from cmlcluster.runs.entry import run_function, run_script, user_frames

    report = os.environ.pop(REPORT_ENV, "")
    try:
        register_cluster()
        use_cpu_collectives()
        if argv[:1] == ["--function"] and len(argv) == 3:
            run_function(argv[1], argv[2], keep_value=os.environ.get("JAX_PROCESS_ID") == "0")
        elif argv and not argv[0].startswith("--"):
            run_script(argv[0], argv[1:])
        else:
            sys.exit("usage: python .../cmlcluster/jax/process.py SCRIPT [ARGS...] | --function CALL RESULT")
        status = 0
    except SystemExit as e:
        status = status_of(e)
    except BaseException as e:
        e.__traceback__ = user_frames(e.__traceback__, [__file__])  # as `python script` would show it
        traceback.print_exception(e)
        if report:
            with open(report, "w") as f:
                json.dump({"failures": [failure(e)]}, f)
        status = 1
    if status != 0:
        # JAX's exit handler (jax.distributed.shutdown) waits at a barrier for every process, which the
        # others, blocked in a collective with this one, never reach: a failed process leaves at once.
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)
    exit_now(status)


if __name__ == "__main__":
    main(sys.argv[1:])
