"""Where and how a run's workers go, for every framework: one options object, checked before anything
starts, and the command-line options that fill it, shared by every magic and CLI verb.

What a framework adds (its processes per worker, its rendezvous timeout, its launcher's arguments) is
its own; what is here means the same in run_torch, run_jax, run_accelerate and run_horovod.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import checks
from ..backends import add_backend_arguments, backend_from
from ..collect.paths import check_collect
from ..errors import ConfigError
from ..workers import Resources, check_env, check_resources

if TYPE_CHECKING:
    from ..backends import Backend
    from ..session import Session


@dataclass(frozen=True)
class WorkerOptions:
    """Each worker's resources, where the workers run, and how the run behaves.

    cpu, memory (GB), nvidia_gpu: per worker. env: variables for every worker. backend: a session of
    the run's own on this backend (closed when the run ends); session: the session to run in; neither:
    the default session. start_timeout: seconds for the workers to run (and a lost one's replacement).
    max_restarts: lost workers replaced in all (0: the first loss fails the run). collect: paths of each
    worker's folder that come home as it ends. ship_working_folder: copy the working folder to workers
    that do not see it. echo: show the run in the session's view. check: raise instead of returning a
    failed result. Made by worker_options(), which checks every value.
    """

    cpu: float = 1
    memory: float = 1
    nvidia_gpu: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    backend: str | Backend | None = None
    session: Session | None = None
    start_timeout: float = 60
    max_restarts: int = 0
    collect: tuple[str, ...] = ()
    ship_working_folder: bool = False
    echo: bool = True
    check: bool = False

    @property
    def resources(self) -> Resources:
        return Resources(self.cpu, self.memory, self.nvidia_gpu)


def worker_options(
    *,
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    env: Mapping[str, str] | None = None,
    backend: str | Backend | None = None,
    session: Session | None = None,
    start_timeout: float = 60,
    max_restarts: int = 0,
    collect: str | Sequence[str] | None = None,
    ship_working_folder: bool = False,
    echo: bool = True,
    check: bool = False,
) -> WorkerOptions:
    """The options of a run's public keywords (what run_torch(cpu=..., ...) was given), each checked:
    ConfigError naming a bad value and the fix, before anything starts."""
    check_resources(cpu, memory, nvidia_gpu)
    if not checks.number(start_timeout, above=0):
        raise ConfigError(f"start_timeout={start_timeout!r}: give a number of seconds above 0")
    if not checks.whole(max_restarts, 0):
        raise ConfigError(f"max_restarts={max_restarts!r}: give a whole number of workers to replace, 0 or more")
    return WorkerOptions(
        cpu=cpu,
        memory=memory,
        nvidia_gpu=nvidia_gpu,
        env=check_env(env),
        backend=backend,
        session=session,
        start_timeout=start_timeout,
        max_restarts=max_restarts,
        collect=check_collect(collect),
        ship_working_folder=ship_working_folder,
        echo=echo,
        check=check,
    )


def add_worker_arguments(parser: argparse.ArgumentParser, *, restarts_help: str) -> None:
    """The options every run's magic and CLI verb has: --cpu, --memory, --gpus, --backend and
    --backend-option, --start-timeout, --max-restarts and --collect."""
    parser.add_argument("--cpu", type=float, default=1, help="cores per worker")
    parser.add_argument("--memory", type=float, default=1, help="GB per worker")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per worker")
    add_backend_arguments(parser)
    parser.add_argument("--start-timeout", type=float, default=60, help="seconds for the workers to start")
    parser.add_argument("--max-restarts", type=int, default=0, help=restarts_help)
    parser.add_argument(
        "--collect", action="append", metavar="PATH", help="a path of each worker's folder that comes here as it ends"
    )


def worker_keywords(arguments: argparse.Namespace) -> dict[str, Any]:
    """The run keywords that add_worker_arguments' options name (cpu=..., backend=..., ...)."""
    return {
        "cpu": arguments.cpu,
        "memory": arguments.memory,
        "nvidia_gpu": arguments.gpus,
        "backend": backend_from(arguments),
        "start_timeout": arguments.start_timeout,
        "max_restarts": arguments.max_restarts,
        "collect": arguments.collect,
    }
