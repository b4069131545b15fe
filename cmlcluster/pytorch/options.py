"""The options of a PyTorch run, shared by %torchrun and `cmlcluster torchrun`."""

from __future__ import annotations

import argparse
from typing import Any

from ..backends import add_backend_arguments, backend_from
from . import commands


def _nproc(value: str) -> int | str:
    return value if value == "auto" else int(value)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="workers, one torchrun each")
    parser.add_argument(
        "--nproc-per-node", type=_nproc, default="auto", help="processes per worker (default auto: its GPUs, or 1)"
    )
    parser.add_argument("--cpu", type=float, default=1, help="cores per worker")
    parser.add_argument("--memory", type=float, default=1, help="GB per worker")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per worker")
    parser.add_argument(
        "--dist-backend", default=None, choices=commands.DIST_BACKENDS, help="default: nccl with GPUs, else gloo"
    )
    add_backend_arguments(parser)
    parser.add_argument("--start-timeout", type=float, default=60, help="seconds for the workers to start")
    parser.add_argument(
        "--join-timeout", type=float, default=commands.DEFAULT_JOIN_TIMEOUT, help="seconds to reach the rendezvous"
    )
    parser.add_argument("--rank0-only", action="store_true", help="show only rank 0's output")
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="replace a lost worker up to N times and resume (elastic)"
    )
    parser.add_argument(
        "--collect", action="append", metavar="PATH", help="a path of each worker's folder that comes here as it ends"
    )


def run(options: argparse.Namespace, script: str, args: list[str], **more: Any) -> Any:
    """run_torch with these options; returns its TorchResult."""
    from .run import run_torch

    return run_torch(
        script,
        args,
        nnodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        cpu=options.cpu,
        memory=options.memory,
        nvidia_gpu=options.gpus,
        dist_backend=options.dist_backend,
        backend=backend_from(options),
        start_timeout=options.start_timeout,
        join_timeout=options.join_timeout,
        rank0_only=options.rank0_only,
        max_restarts=options.max_restarts,
        collect=options.collect,
        **more,
    )
