"""%jaxrun's and `cmlcluster jaxrun`'s options."""

from __future__ import annotations

import argparse
from typing import Any

from ..runs.options import add_worker_arguments, worker_keywords

HELP = "run a script as one JAX process on each of fresh workers (jax.distributed)"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="workers, one JAX process each")
    add_worker_arguments(parser, restarts_help="JAX runs are not elastic: 0")


def run(options: argparse.Namespace, script: str, args: list[str], **more: Any) -> Any:
    """run_jax with these options; returns its JaxResult."""
    from .run import run_jax

    keywords = worker_keywords(options)
    if keywords.pop("max_restarts"):
        from ..errors import ConfigError

        raise ConfigError("--max-restarts: a JAX run is not elastic (its processes cannot rejoin); leave it out")
    return run_jax(script, args, nnodes=options.nnodes, **keywords, **more)
