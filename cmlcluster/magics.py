"""IPython magics, registered by ``%load_ext cmlcluster``:

    %horovod [options] train.py [script args]     run a script under horovodrun on fresh workers
    %%horovod [options]                           the cell is the training script

Options: -np N (processes in all), -n/--workers N, --slots S (processes per worker; default
its GPUs or 1), --cpu, --memory (GB), --gpus (per worker), --backend NAME, --start-timeout S,
--ssh-port P, --reuse (keep the workers for the next run). The value is a HorovodResult.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import tempfile
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from .horovod import options


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the kernel
        raise UsageError(f"%horovod: {message}\n{self.format_usage()}")


def _parser(with_script: bool) -> argparse.ArgumentParser:
    parser = _Parser(prog="%horovod" if with_script else "%%horovod", add_help=False)
    options.add_options(parser)
    parser.add_argument("--reuse", action="store_true")
    if with_script:
        parser.add_argument("script")
        parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _run(parsed: argparse.Namespace, script: str, args: list[str]) -> Any:
    return options.run(parsed, script, args, reuse=parsed.reuse)


@magics_class
class ClusterMagics(Magics):
    @line_magic
    def horovod(self, line: str) -> Any:
        """%horovod [options] train.py [args]: run a training script under horovodrun on workers."""
        parsed = _parser(with_script=True).parse_args(shlex.split(line))
        return _run(parsed, parsed.script, parsed.args)

    @cell_magic("horovod")  # type: ignore[arg-type]  # IPython types the named form poorly
    def horovod_cell(self, line: str, cell: str) -> Any:
        """%%horovod [options]: the cell is the training script."""
        parsed = _parser(with_script=False).parse_args(shlex.split(line))
        # A private file, shipped to workers that do not see it like any script; removed afterwards.
        folder = tempfile.mkdtemp(prefix="cmlcluster-cell-")
        path = os.path.join(folder, "horovod_cell.py")
        with open(path, "w") as f:
            f.write(cell)
        try:
            return _run(parsed, path, [])
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(ClusterMagics)
