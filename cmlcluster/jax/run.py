"""run_jax: JAX multi-process training (jax.distributed) on workers, one JAX process per worker.

Every worker runs one process (node.py) that sees all of its worker's devices. Process 0's worker
picks a free port for JAX's coordinator; every process gets Kubeflow's JAX runtime's variables
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), so that scripts written for it, and a
plain ``jax.distributed.initialize()``, run unchanged; on CPUs, collectives across processes go over
Gloo. A function's return value comes back from process 0. The first failure ends the run, and the
workers belong to it (runs/skeleton.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import checks
from ..errors import ConfigError
from ..runs import skeleton
from ..runs.nodes import NodeFramework, entry_of
from ..runs.options import WorkerOptions, worker_options
from ..runs.result import NodesResult, RunError

if TYPE_CHECKING:
    from ..backends import Backend
    from ..session import Session
    from ..shipping import Shipment


@dataclass(repr=False)
class JaxResult(NodesResult):
    """What a JAX run did: its exit code, each process's output (by process id), which one failed and why,
    and process 0's return value for a function."""

    launcher = "JAX"
    job = "JAX job"


class JaxError(RunError):
    """run_jax(check=True) failed; `result` is its JaxResult."""


def run_jax(
    script: str | Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    nnodes: int = 1,
    kwargs: Mapping[str, Any] | None = None,
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    env: Mapping[str, str] | None = None,
    backend: str | Backend | None = None,
    session: Session | None = None,
    start_timeout: float = 60,
    ship_working_folder: bool = False,
    collect: str | Sequence[str] | None = None,
    echo: bool = True,
    check: bool = False,
) -> JaxResult:
    """Run `script args` (or `script(*args, **kwargs)`) as one JAX process on each of `nnodes` workers.

    Parameters
    ----------
    script : str | Callable[..., Any]
        The script's path (shipped to workers that do not see it), or a function, pickled with
        cloudpickle, whose return value on process 0 comes back as result.value.
    args : Sequence[Any], default ()
        A script's arguments (strings); a function's positional arguments.
    nnodes : int, default 1
        Workers, one JAX process each: a whole number, 1 or more.
    kwargs : Mapping[str, Any] | None, default None
        A function's keyword arguments.
    cpu, memory, nvidia_gpu, env, backend, session, start_timeout, ship_working_folder, collect, echo, check
        As for run_torch: each worker's cores, GB and GPUs; its variables; where the run goes; seconds for
        the workers to run; what is shipped and what comes home; the view; raise JaxError on failure.

    Returns
    -------
    JaxResult
        ok, exit_code, output (process id -> its last lines), failure (the process that failed first, and
        its traceback), worker_failure, hosts, master (the coordinator's address) and value.

    Raises
    ------
    ConfigError
        Before any worker starts: a bad number, env, collect, script or function (as run_torch's).
    JaxError
        With check=True, the run failed.

    Examples
    --------
    ::

        result = cmlcluster.run_jax("train.py", ["--steps", "100"], nnodes=2)

        def total():
            import jax, jax.numpy as jnp
            jax.distributed.initialize()
            f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
            return float(f(jnp.ones(jax.local_device_count()))[0])

        cmlcluster.run_jax(total, nnodes=2).value  # 2.0
    """
    options = worker_options(
        cpu=cpu,
        memory=memory,
        nvidia_gpu=nvidia_gpu,
        env=env,
        backend=backend,
        session=session,
        start_timeout=start_timeout,
        collect=collect,
        ship_working_folder=ship_working_folder,
        echo=echo,
        check=check,
    )
    return skeleton.run(options, Jax(script, args, kwargs, nnodes, options))


class Jax(NodeFramework[JaxResult]):
    """A JAX run on the skeleton: one process per node, JAX's coordinator on node 0's worker."""

    run_name = "JAX"
    job_name = "JAX job"
    node_function = "cmlcluster.jax.node:run"

    def __init__(
        self,
        script: str | Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        nnodes: int,
        options: WorkerOptions,
    ):
        if not checks.whole(nnodes, 1):
            raise ConfigError(f"nnodes={nnodes!r}: give a whole number of workers, 1 or more")
        self.nnodes = nnodes
        self.call, self.path, self.script_args = entry_of(script, args, kwargs, "run_jax")
        self.files = [self.path] if self.path else []
        self.title = f"run_jax {os.path.basename(self.path) or getattr(script, '__name__', 'function')}"
        self.settings = {"nnodes": nnodes, "threads": max(1, int(options.cpu)), "gpus": options.nvidia_gpu}

    def new_result(self) -> JaxResult:
        return JaxResult(exit_code=-1, nnodes=self.nnodes, nproc_per_node=1, hosts=[], master="", duration=0)

    def error(self, result: JaxResult) -> JaxError:
        return JaxError(result)

    def plan(self, shipment: Shipment) -> dict[str, Any]:
        return {
            **self.settings,
            "call": self.call,
            "args": self.script_args,
            "script": shipment.names.get(self.path, ""),
        }
