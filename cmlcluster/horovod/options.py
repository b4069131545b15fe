"""The options of a Horovod run, shared by %horovod and `cmlcluster horovod`."""

from __future__ import annotations

import argparse
from typing import Any

from ..backends import add_backend_arguments, backend_from
from . import commands


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", type=int, default=None, help="processes in all (default: workers x slots)")
    parser.add_argument("-n", "--workers", type=int, default=None, help="workers (default: enough for -np)")
    parser.add_argument("--slots", type=int, default=None, help="processes per worker (default: its GPUs, or 1)")
    parser.add_argument("--cpu", type=float, default=1, help="cores per worker")
    parser.add_argument("--memory", type=float, default=1, help="GB per worker")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per worker")
    add_backend_arguments(parser)
    parser.add_argument("--start-timeout", type=int, default=60, help="seconds for workers and ranks to start")
    parser.add_argument("--ssh-port", type=int, default=commands.SSH_PORT, help="the workers' sshd port")
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="replace a lost worker up to N times and go on (elastic)"
    )
    parser.add_argument(
        "--collect", action="append", metavar="PATH", help="a path of each worker's folder that comes here as it ends"
    )


def run(options: argparse.Namespace, script: str, args: list[str], **more: Any) -> Any:
    """run_horovod with these options; returns its HorovodResult."""
    from .run import run_horovod

    return run_horovod(
        script,
        args,
        np=options.np,
        workers=options.workers,
        slots=options.slots,
        cpu=options.cpu,
        memory=options.memory,
        nvidia_gpu=options.gpus,
        backend=backend_from(options),
        start_timeout=options.start_timeout,
        ssh_port=options.ssh_port,
        max_restarts=options.max_restarts,
        collect=options.collect,
        **more,
    )
