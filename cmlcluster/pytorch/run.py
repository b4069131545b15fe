"""run_torch: PyTorch distributed training (DDP and the rest of torch.distributed) on workers.

One worker per node, all launched together as one job. Worker 0's agent picks a port free
there; every worker then starts ``torchrun --node-rank i --master-addr <worker 0's address>
--master-port <that port>`` at once. Worker 0's opens the static rendezvous; every other one
first imports torch, then waits until it can connect to that endpoint, and only then joins
(launch.py), so that the check costs no time. torchrun sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process. Every process's output streams
back live as ``[rank r] text`` in its worker's output.

The first failure ends the run: a process that fails ends its node's torchrun, whose worker
reports which rank failed, with the traceback from torchrun's error file; a worker that ends
(killed, crashed) fails the job. Either way every other worker is stopped at once, and with
it every process it ran. The workers belong to the run and are stopped when it ends.

With max_restarts=N the run is elastic instead: the rendezvous is torchrun's c10d one, its store
hosted by the session (store.py), so that it outlives any worker. A worker lost mid-run is
replaced by the job (jobs.Restarts) with a new one of the same resources, whose node joins the
rendezvous; torchrun restarts the other nodes' processes, and they all resume from the script's
last snapshot (docs/guide/pytorch.md, "Surviving a lost worker").
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .. import checks
from ..errors import ConfigError
from ..runs import skeleton
from ..runs.nodes import NodeFramework, entry_of
from ..runs.options import WorkerOptions, worker_options
from . import commands
from .result import TorchError, TorchResult
from .store import SessionStore

TR = TypeVar("TR", bound=TorchResult)

if TYPE_CHECKING:
    from ..backends import Backend
    from ..events import Member
    from ..jobs import Job
    from ..session import Session
    from ..shipping import Shipment


def run_torch(
    script: str | Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    nnodes: int = 1,
    nproc_per_node: int | str = "auto",
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    dist_backend: str | None = None,
    backend: str | Backend | None = None,
    session: Session | None = None,
    start_timeout: float = 60,
    join_timeout: float = commands.DEFAULT_JOIN_TIMEOUT,
    rank0_only: bool = False,
    max_restarts: int = 0,
    ship_working_folder: bool = False,
    collect: str | Sequence[str] | None = None,
    echo: bool = True,
    check: bool = False,
) -> TorchResult:
    """Run `script args` (or `script(*args, **kwargs)` for a function) under torchrun on `nnodes` workers.

    One worker per node, launched together as one job; each starts torchrun, which sets RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process, and every process's output
    streams back as ``[rank r] text``. The first failure ends the run, and the workers belong to the
    run: they are stopped when it ends. Bad arguments are refused before any worker starts.

    Parameters
    ----------
    script : str | Callable[..., Any]
        The training script's path (relative to the working folder; shipped to workers that do not
        see it), or a function, pickled with cloudpickle, whose return value on rank 0 comes back as
        result.value.
    args : Sequence[Any], default ()
        A script's arguments, a list of strings (e.g. ``["--epochs", "3"]``); a function's
        positional arguments.
    nnodes : int, default 1
        Workers, one torchrun each: a whole number, 1 or more.
    nproc_per_node : int | str, default "auto"
        Processes per worker ("auto": its GPUs, or 1); with GPUs, at most nvidia_gpu.
    cpu : float, default 1
        Cores per worker, shared among its processes (OMP_NUM_THREADS).
    memory : float, default 1
        Memory per worker, in GB.
    nvidia_gpu : int, default 0
        GPUs per worker, a whole number, 0 or more.
    kwargs : Mapping[str, Any] | None, default None
        A function's keyword arguments; not for a script (pass its options in args).
    env : Mapping[str, str] | None, default None
        Variables for every worker. Workers get env= and cmlcluster's own variables
        (docs/guide/workers.md, "What workers see").
    dist_backend : str | None, default None
        What cmlcluster.pytorch.init_process_group() uses: "gloo", "nccl", "mpi" or "ucc"; None:
        "nccl" with GPUs, else "gloo" ("nccl" needs GPUs). Its name is in CMLCLUSTER_DIST_BACKEND.
    backend : str | Backend | None, default None
        Without `session`: run in a session of its own on this backend, closed when the run ends.
        None: the default session (cmlcluster.get_session()).
    session : Session | None, default None
        The session to run in.
    start_timeout : float, default 60
        Seconds, above 0, for the workers to run (and for a lost worker's replacement).
    join_timeout : float, default 120
        Seconds, above 0, for every node to reach worker 0's rendezvous (the session's, in an elastic
        run).
    rank0_only : bool, default False
        Stream only rank 0's output.
    max_restarts : int, default 0
        Replace a lost worker up to this many times in all, and restart the ranks (torchrun's elastic
        mode; the script resumes from its snapshot: docs/guide/pytorch.md); needs torch in this Python
        too, which hosts the rendezvous. 0: a static run, the first loss fails it.
    ship_working_folder : bool, default False
        Copy the working folder to workers that do not see it.
    collect : str | Sequence[str] | None, default None
        Paths under the workers' folders ("outputs", "checkpoints") whose files come to this working
        folder when each worker ends, where workers do not share it (launch_workers' collect=).
    echo : bool, default True
        Show the run in the session's view, and how it ended.
    check : bool, default False
        Raise TorchError instead of returning a failed result.

    Returns
    -------
    TorchResult
        What the run did: ok, exit_code, each rank's last lines (output), failed_rank and failure
        (the rank that failed first, and why), worker_failure (a worker that ended during the run),
        master, hosts, value (a function's, from rank 0) and restarts.

    Raises
    ------
    ConfigError
        Before any worker starts: nnodes, nproc_per_node, cpu, memory, nvidia_gpu, start_timeout,
        join_timeout or max_restarts out of range; an unknown dist_backend, or "nccl" without GPUs; max_restarts
        without torch in this Python; kwargs with a script, or a script that is neither a file nor a
        function; args of a script that are not strings; a function that cannot be pickled, or no
        cloudpickle; a bad env or collect entry.
    cmlcluster.jobs.JobStartFailed
        A node's worker did not start; every worker that did was stopped.
    TorchError
        With check=True, the run failed; its `result` is the TorchResult.
    KeyboardInterrupt
        Ctrl-C: raised again once every worker, and every process they ran, was stopped.

    Examples
    --------
    ::

        result = cmlcluster.run_torch("train.py", ["--epochs", "3"], nnodes=2, nproc_per_node=2)
        result.ok, result.exit_code, result.output[3], result.failed_rank, result.failure, result.master
        result = cmlcluster.run_torch("train.py", nnodes=4, max_restarts=2)  # a lost worker replaced, twice at most

        def train(lr):  # a function, pickled to the workers
            ...
            return accuracy

        cmlcluster.run_torch(train, (0.1,), nnodes=2).value  # rank 0's return value
    """
    # Everything is checked before anything starts.
    options = worker_options(
        cpu=cpu,
        memory=memory,
        nvidia_gpu=nvidia_gpu,
        env=env,
        backend=backend,
        session=session,
        start_timeout=start_timeout,
        max_restarts=max_restarts,
        collect=collect,
        ship_working_folder=ship_working_folder,
        echo=echo,
        check=check,
    )
    torch = Torch(
        script,
        args,
        kwargs,
        nnodes,
        nproc_per_node,
        options,
        function_of="run_torch",
        dist_backend=dist_backend,
        join_timeout=join_timeout,
        rank0_only=rank0_only,
    )
    return skeleton.run(options, torch)


def needs_torch_here(max_restarts: int) -> None:
    """An elastic run's rendezvous store lives in the session: PyTorch must be importable here."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError(
            f"max_restarts={max_restarts} needs PyTorch here too ({sys.executable}): the session hosts the "
            "rendezvous that outlives any worker; pip install torch, or pass max_restarts=0"
        )


class TorchNodes(NodeFramework[TR]):
    """A run of torchrun on each node (node.py): its static rendezvous on node 0's worker, or, elastic,
    the session's store (store.py). PyTorch's run (Torch) and Accelerate's are its two kinds."""

    run_name = "torchrun"
    job_name = "PyTorch job"
    node_function = "cmlcluster.pytorch.node:run"
    launcher = "torch"  # which launcher node.py starts

    def __init__(
        self,
        script: str | Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        nnodes: int,
        nproc_per_node: int | str,
        options: WorkerOptions,
        *,
        function_of: str,
        dist_backend: str | None,
        join_timeout: float,
        rank0_only: bool,
    ):
        """Checks its arguments (ConfigError, before anything starts): `function_of` names the caller."""
        if not checks.whole(nnodes, 1):
            raise ConfigError(f"nnodes={nnodes!r}: give a whole number of workers, 1 or more")
        if not checks.number(join_timeout, above=0):
            raise ConfigError(f"join_timeout={join_timeout!r}: give a number of seconds above 0")
        if options.max_restarts:
            needs_torch_here(options.max_restarts)
        self.nnodes = nnodes
        self.nproc = commands.nproc_for(nproc_per_node, options.nvidia_gpu)
        self.call, self.path, self.script_args = entry_of(script, args, kwargs, function_of)
        self.files = [self.path] if self.path else []
        name = os.path.basename(self.path) or getattr(script, "__name__", "function")
        self.title = f"{function_of} {name}"
        self.settings: dict[str, Any] = {  # what every node is given (node.py)
            "launcher": self.launcher,
            "nnodes": nnodes,
            "nproc_per_node": self.nproc,
            "join_timeout": join_timeout,
            "threads": commands.threads_per_process(options.cpu, self.nproc),
            "dist_backend": commands.dist_backend_for(dist_backend, options.nvidia_gpu),
            "rank0_only": rank0_only,
            "max_restarts": options.max_restarts,
        }

    def plan(self, shipment: Shipment) -> dict[str, Any]:
        return {
            **self.settings,
            "call": self.call,
            "args": self.script_args,
            "script": shipment.names.get(self.path, ""),
        }

    def node_plan(self, plan: dict[str, Any], member: Member) -> dict[str, Any]:
        if "endpoint" in plan:  # elastic: each round gives the node its rank
            return {**plan, "local_addr": member.address}
        return {**plan, "node_rank": member.index}  # nodes but 0 wait for its rendezvous (launch.py)

    @contextlib.contextmanager
    def rendezvous(self, session: Session, job: Job, elastic: bool) -> Iterator[dict[str, Any]]:
        if not elastic:
            with super().rendezvous(session, job, elastic) as static:
                yield static
            return
        # Where workers reach the session (known once its first workers run): no worker's loss ends it.
        # The run id (128 random bits) and the key that signs the rendezvous state travel in the plan,
        # over the encrypted control plane, to each node's environment (node.py): never a command line.
        store = SessionStore(session.controller_ip)
        try:
            yield {
                "master": store.endpoint,
                "endpoint": store.endpoint,
                "run_id": f"cmlcluster-{secrets.token_hex(16)}",
                "rdzv_key": secrets.token_hex(32),
            }
        finally:
            store.close()


class Torch(TorchNodes[TorchResult]):
    """A PyTorch run on the skeleton."""

    def new_result(self) -> TorchResult:
        return TorchResult(exit_code=-1, nnodes=self.nnodes, nproc_per_node=self.nproc, hosts=[], master="", duration=0)

    def error(self, result: TorchResult) -> TorchError:
        return TorchError(result)
