"""IPython magics, registered by ``%load_ext cmlcluster``:

    %horovod [options] train.py [script args]     run a script under horovodrun on fresh workers
    %%horovod [options]                           the cell is the training script
    %torchrun [options] train.py [script args]    run a script under torchrun on fresh workers
    %%torchrun [options]                          the cell is the training script

%horovod's options: -np N (processes in all), -n/--workers N, --slots S (processes per worker;
default its GPUs or 1), --cpu, --memory (GB), --gpus (per worker), --backend NAME,
--start-timeout S, --ssh-port P, --reuse (keep the workers for the next run), --max-restarts N,
--collect PATH (repeatable: what comes home from each worker's folder as it ends). Its value is a
HorovodResult.

%torchrun's options: --nnodes N (workers), --nproc-per-node K (default: the worker's GPUs, or 1),
--cpu, --memory (GB), --gpus (per worker), --dist-backend gloo|nccl, --backend NAME,
--start-timeout S, --join-timeout S, --rank0-only, --max-restarts N, --collect PATH. Its value is a
TorchResult.
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
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from .horovod import options as horovod_options
from .pytorch import options as torch_options


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _parser(name: str, add_options: Callable[[argparse.ArgumentParser], None], with_script: bool) -> _Parser:
    parser = _Parser(prog=f"%{name}" if with_script else f"%%{name}", add_help=False)
    add_options(parser)
    if with_script:
        parser.add_argument("script")
        parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _horovod_options(parser: argparse.ArgumentParser) -> None:
    horovod_options.add_options(parser)
    parser.add_argument("--reuse", action="store_true")


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


@magics_class
class ClusterMagics(Magics):
    @line_magic
    def horovod(self, line: str) -> Any:
        """%horovod [options] train.py [args]: run a training script under horovodrun on workers."""
        parsed = _parser("horovod", _horovod_options, with_script=True).parse_args(shlex.split(line))
        return horovod_options.run(parsed, parsed.script, parsed.args, reuse=parsed.reuse)

    @cell_magic("horovod")  # type: ignore[arg-type]  # IPython types the named form poorly
    def horovod_cell(self, line: str, cell: str) -> Any:
        """%%horovod [options]: the cell is the training script."""
        parsed = _parser("horovod", _horovod_options, with_script=False).parse_args(shlex.split(line))
        return _run_cell(cell, "horovod", lambda path: horovod_options.run(parsed, path, [], reuse=parsed.reuse))

    @line_magic
    def torchrun(self, line: str) -> Any:
        """%torchrun [options] train.py [args]: run a training script under torchrun on workers."""
        parsed = _parser("torchrun", torch_options.add_options, with_script=True).parse_args(shlex.split(line))
        return torch_options.run(parsed, parsed.script, parsed.args)

    @cell_magic("torchrun")  # type: ignore[arg-type]
    def torchrun_cell(self, line: str, cell: str) -> Any:
        """%%torchrun [options]: the cell is the training script."""
        parsed = _parser("torchrun", torch_options.add_options, with_script=False).parse_args(shlex.split(line))
        return _run_cell(cell, "torchrun", lambda path: torch_options.run(parsed, path, []))


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(ClusterMagics)
