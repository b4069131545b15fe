"""The run verbs, from one table: each framework's magic (%name and %%name, the cell as its script) and
CLI verb (`cmlcluster name`) parse the same options and call the same run.

Each framework's options module has HELP, add_options(parser) and run(arguments, script, args, **more);
add_magic_options(parser), where it has options only a notebook can use (%horovod --reuse).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

VERBS = {
    "horovod": "cmlcluster.horovod.options",
    "torchrun": "cmlcluster.pytorch.options",
    "jaxrun": "cmlcluster.jax.options",
    "accelerate": "cmlcluster.accelerate.options",
}


def options_of(verb: str) -> ModuleType:
    return importlib.import_module(VERBS[verb])


def add_verb_arguments(parser: argparse.ArgumentParser, verb: str, *, magic: bool, with_script: bool) -> None:
    """The verb's options (and, with_script, the script and its arguments) on `parser`."""
    options = options_of(verb)
    options.add_options(parser)
    if magic and hasattr(options, "add_magic_options"):
        options.add_magic_options(parser)
    if with_script:
        parser.add_argument("script")
        parser.add_argument("args", nargs=argparse.REMAINDER)
