"""%torchrun's and `cmlcluster torchrun`'s options."""

from __future__ import annotations

import argparse
from typing import Any

from ..runs.options import add_worker_arguments, worker_keywords
from . import commands

HELP = "run a script under torchrun (PyTorch distributed) on fresh workers"


def _nproc(value: str) -> int | str:
    return value if value == "auto" else int(value)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="workers, one torchrun each")
    parser.add_argument(
        "--nproc-per-node", type=_nproc, default="auto", help="processes per worker (default auto: its GPUs, or 1)"
    )
    parser.add_argument(
        "--dist-backend", default=None, choices=commands.DIST_BACKENDS, help="default: nccl with GPUs, else gloo"
    )
    add_node_arguments(parser)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """What every run of torchrun's nodes has (%torchrun's, %accelerate's): the rendezvous timeout,
    rank 0's output alone, elastic restarts, and the worker options."""
    parser.add_argument(
        "--join-timeout", type=float, default=commands.DEFAULT_JOIN_TIMEOUT, help="seconds to reach the rendezvous"
    )
    parser.add_argument("--rank0-only", action="store_true", help="show only rank 0's output")
    add_worker_arguments(parser, restarts_help="replace a lost worker up to N times and resume (elastic)")


def run(options: argparse.Namespace, script: str, args: list[str], **more: Any) -> Any:
    """run_torch with these options; returns its TorchResult."""
    from .run import run_torch

    return run_torch(
        script,
        args,
        nnodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        dist_backend=options.dist_backend,
        join_timeout=options.join_timeout,
        rank0_only=options.rank0_only,
        **worker_keywords(options),
        **more,
    )
