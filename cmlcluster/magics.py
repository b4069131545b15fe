"""IPython magics, registered by ``%load_ext cmlcluster``: one for each run verb (cmlcluster.runs.verbs).

    %horovod [options] train.py [script args]     run a script under horovodrun on fresh workers
    %torchrun [options] train.py [script args]    run a script under torchrun on fresh workers
    %jaxrun [options] train.py [script args]      run a script as one JAX process on each of fresh workers
    %accelerate [options] train.py [script args]  run an Accelerate script on fresh workers, one machine each
    %%horovod [options], %%torchrun, ...          the cell is the script
    %xray [worker ...]                            where every rank of the running workers is now (cdsw.xray)

Every verb has --cpu, --memory (GB), --gpus (per worker), --backend NAME (and --backend-option KEY=VALUE),
--start-timeout S, --max-restarts N and --collect PATH (repeatable: what comes home from each worker's
folder as it ends). %horovod: -np N, -n/--workers N, --slots S, --ssh-port P, --reuse (keep the workers
for the next run). %torchrun: --nnodes N, --nproc-per-node K, --dist-backend gloo|nccl, --join-timeout S,
--rank0-only. %jaxrun: --nnodes N. %accelerate: --num-machines N, --num-processes K, --launch-args '...',
--join-timeout S, --rank0-only (`cmlcluster VERB --help` describes each). Each returns its run's result.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError

from .runs.verbs import VERBS, add_verb_arguments, options_of


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _parser(verb: str, with_script: bool) -> _Parser:
    parser = _Parser(prog=f"%{verb}" if with_script else f"%%{verb}", add_help=False)
    add_verb_arguments(parser, verb, magic=True, with_script=with_script)
    return parser


def _run_cell(cell: str, name: str, run: Callable[[str], Any]) -> Any:
    """Run a cell as a script: a private file, shipped to workers that do not see it like any script."""
    folder = tempfile.mkdtemp(prefix="cmlcluster-cell-")
    path = os.path.join(folder, f"{name}_cell.py")
    with open(path, "w") as f:
        f.write(cell)
    try:
        return run(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def magic(verb: str) -> Callable[..., Any]:
    """%verb [options] script [args], and %%verb [options] with the cell as the script."""

    def run_verb(line: str, cell: str | None = None) -> Any:
        parsed = _parser(verb, with_script=cell is None).parse_args(shlex.split(line))
        more = {"reuse": parsed.reuse} if hasattr(parsed, "reuse") else {}
        run = options_of(verb).run
        if cell is None:
            return run(parsed, parsed.script, parsed.args, **more)
        return _run_cell(cell, verb, lambda path: run(parsed, path, [], **more))

    run_verb.__name__ = verb
    run_verb.__doc__ = f"%{verb} [options] script [args] | %%{verb} [options]: {options_of(verb).HELP}"
    return run_verb


def xray(line: str) -> Any:
    """%xray [worker ...]: where every rank of the default session's running workers (or of these) is now."""
    from . import api

    return api.xray(*shlex.split(line))


def load_ipython_extension(ipython: Any) -> None:
    for verb in VERBS:
        ipython.register_magic_function(magic(verb), magic_kind="line_cell", magic_name=verb)
    ipython.register_magic_function(xray, magic_kind="line", magic_name="xray")
