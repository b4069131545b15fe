"""run_accelerate: a Hugging Face Accelerate script on several workers, one machine each.

Every worker is one of Accelerate's machines: its node runs Accelerate's launch (launch.py) with its
machine rank, the main process's address and port (node 0's worker, a static rendezvous) and the
user's launch arguments, and Accelerate's launcher runs torchrun. So everything run_torch does holds:
each process's lines as ``[rank r] text``, the first failure named with its traceback, every worker
stopped at the end, and max_restarts' elastic runs. On CPUs the processes use Gloo; with GPUs, NCCL
and one process per GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import checks
from ..errors import ConfigError
from ..pytorch import commands
from ..pytorch.result import TorchResult
from ..pytorch.run import TorchNodes
from ..runs import skeleton
from ..runs.options import WorkerOptions, worker_options
from ..runs.result import RunError
from .launch import TOPOLOGY

if TYPE_CHECKING:
    from ..backends import Backend
    from ..session import Session

UNSUPPORTED = {"--use_deepspeed": "DeepSpeed's launcher", "--use_megatron_lm": "Megatron-LM's launcher"}


@dataclass(repr=False)
class AccelerateResult(TorchResult):
    """What an Accelerate run did: as a TorchResult (its processes are torchrun's)."""

    launcher = "accelerate launch"
    job = "Accelerate job"


class AccelerateError(RunError):
    """run_accelerate(check=True) failed; `result` is its AccelerateResult."""


def run_accelerate(
    script: str,
    args: Sequence[str] = (),
    *,
    num_machines: int = 1,
    num_processes: int | None = None,
    launch_args: Sequence[str] = (),
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    env: Mapping[str, str] | None = None,
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
) -> AccelerateResult:
    """Run an Accelerate script (its Accelerator, prepare, gather) on `num_machines` workers.

    Parameters
    ----------
    script : str
        The script's path (shipped to workers that do not see it).
    args : Sequence[str], default ()
        The script's arguments.
    num_machines : int, default 1
        Workers, one of Accelerate's machines each.
    num_processes : int | None, default None
        Processes in all, as accelerate launch counts them: a multiple of num_machines (None: one per GPU
        of each worker, or one per worker).
    launch_args : Sequence[str], default ()
        More of accelerate launch's own arguments, e.g. ``["--mixed_precision", "bf16"]``,
        ``["--config_file", "fsdp.yaml"]``; the run's shape (machines, ranks, addresses) is cmlcluster's.
    cpu, memory, nvidia_gpu, env, backend, session, start_timeout, join_timeout, rank0_only, max_restarts
        As for run_torch (max_restarts: a lost worker replaced, the processes restarted from the script's
        last checkpoint).
    ship_working_folder, collect, echo, check
        As for run_torch; check raises AccelerateError.

    Returns
    -------
    AccelerateResult
        As run_torch's TorchResult: ok, exit_code, output, failed_rank, failure, worker_failure, hosts,
        master, restarts.

    Raises
    ------
    ConfigError
        Before any worker starts: a bad number, env, collect or script; num_processes not a multiple of
        num_machines; a launch argument that sets the run's shape, or DeepSpeed's launcher.
    AccelerateError
        With check=True, the run failed.

    Examples
    --------
    ::

        cmlcluster.run_accelerate("train.py", ["--epochs", "3"], num_machines=2)
        cmlcluster.run_accelerate("train.py", num_machines=2, nvidia_gpu=4, launch_args=["--mixed_precision", "bf16"])
    """
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
    if callable(script):
        raise ConfigError(
            "run_accelerate(script=...): give the path of an Accelerate script (run_torch runs functions)"
        )
    accelerate = Accelerate(
        script,
        args,
        num_machines,
        _per_machine(num_processes, num_machines),
        options,
        launch_args=launch_args,
        join_timeout=join_timeout,
        rank0_only=rank0_only,
    )
    return skeleton.run(options, accelerate)


def _per_machine(num_processes: int | None, num_machines: int) -> int | str:
    if num_processes is None:
        return "auto"
    if not checks.whole(num_processes, 1) or not checks.whole(num_machines, 1) or num_processes % num_machines:
        raise ConfigError(
            f"num_processes={num_processes!r} on num_machines={num_machines!r}: give a multiple of the machines "
            "(each runs as many), or leave num_processes out"
        )
    return num_processes // num_machines


def check_launch_args(launch_args: Sequence[str]) -> list[str]:
    if isinstance(launch_args, str) or not all(isinstance(a, str) for a in launch_args):
        raise ConfigError(f"launch_args={launch_args!r}: give a list of strings, e.g. ['--mixed_precision', 'bf16']")
    for arg in launch_args:
        option = arg.split("=", 1)[0]
        if option in TOPOLOGY:
            raise ConfigError(
                f"launch_args: {option} is the run's shape, which cmlcluster sets: use num_machines=, "
                "num_processes= or nvidia_gpu= instead"
            )
        if option in UNSUPPORTED:
            raise ConfigError(f"launch_args: {option}: {UNSUPPORTED[option]} is not supported; use FSDP or DDP")
    return list(launch_args)


class Accelerate(TorchNodes[AccelerateResult]):
    """An Accelerate run on the skeleton: a PyTorch run whose nodes launch through Accelerate."""

    run_name = "accelerate launch"
    job_name = "Accelerate job"
    launcher = "accelerate"

    def __init__(
        self,
        script: str,
        args: Sequence[str],
        num_machines: int,
        nproc_per_node: int | str,
        options: WorkerOptions,
        *,
        launch_args: Sequence[str],
        join_timeout: float,
        rank0_only: bool,
    ):
        launch = check_launch_args(launch_args)
        if not checks.whole(num_machines, 1):
            raise ConfigError(f"num_machines={num_machines!r}: give a whole number of workers, 1 or more")
        super().__init__(
            script,
            args,
            None,
            num_machines,
            nproc_per_node,
            options,
            function_of="run_accelerate",
            dist_backend=None,  # NCCL with GPUs, Gloo without: Accelerate's own choice
            join_timeout=join_timeout,
            rank0_only=rank0_only,
        )
        self.settings["launch_args"] = launch

    def new_result(self) -> AccelerateResult:
        return AccelerateResult(
            exit_code=-1, nnodes=self.nnodes, nproc_per_node=self.nproc, hosts=[], master="", duration=0
        )

    def error(self, result: AccelerateResult) -> AccelerateError:
        return AccelerateError(result)
