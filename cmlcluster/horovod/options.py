"""%horovod's and `cmlcluster horovod`'s options."""

from __future__ import annotations

import argparse
from typing import Any

from ..runs.options import add_worker_arguments, worker_keywords
from . import commands

HELP = "run a script under horovodrun on fresh workers"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", type=int, default=None, help="processes in all (default: workers x slots)")
    parser.add_argument("-n", "--workers", type=int, default=None, help="workers (default: enough for -np)")
    parser.add_argument("--slots", type=int, default=None, help="processes per worker (default: its GPUs, or 1)")
    parser.add_argument("--ssh-port", type=int, default=commands.SSH_PORT, help="the workers' sshd port")
    add_worker_arguments(parser, restarts_help="replace a lost worker up to N times and go on (elastic)")


def add_magic_options(parser: argparse.ArgumentParser) -> None:
    """What only the magic has: the notebook keeps the workers between runs."""
    parser.add_argument("--reuse", action="store_true", help="keep the workers for the next run")


def run(options: argparse.Namespace, script: str, args: list[str], **more: Any) -> Any:
    """run_horovod with these options; returns its HorovodResult."""
    from .run import run_horovod

    keywords = worker_keywords(options)
    if float(keywords["start_timeout"]).is_integer():  # whole seconds, as horovodrun's --start-timeout takes them
        keywords["start_timeout"] = int(keywords["start_timeout"])
    return run_horovod(
        script,
        args,
        np=options.np,
        workers=options.workers,
        slots=options.slots,
        ssh_port=options.ssh_port,
        **keywords,
        **more,
    )
