"""%accelerate's and `cmlcluster accelerate`'s options."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from ..pytorch.options import add_node_arguments
from ..runs.options import worker_keywords

HELP = "run an Accelerate script on fresh workers, one machine each"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-machines", type=int, default=1, help="workers, one of Accelerate's machines each")
    parser.add_argument(
        "--num-processes", type=int, default=None, help="processes in all (default: each worker's GPUs, or 1 each)"
    )
    parser.add_argument(
        "--launch-args",
        default="",
        metavar="'ARGS'",
        help="more of accelerate launch's arguments, quoted: '--mixed_precision bf16'",
    )
    add_node_arguments(parser)


def run(options: argparse.Namespace, script: str, args: list[str], **more: Any) -> Any:
    """run_accelerate with these options; returns its AccelerateResult."""
    from .run import run_accelerate

    return run_accelerate(
        script,
        args,
        num_machines=options.num_machines,
        num_processes=options.num_processes,
        launch_args=shlex.split(options.launch_args),
        join_timeout=options.join_timeout,
        rank0_only=options.rank0_only,
        **worker_keywords(options),
        **more,
    )
