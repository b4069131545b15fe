"""Hugging Face Accelerate across workers: run_accelerate, and the %accelerate magic.

- run.py: run_accelerate and what it returns (AccelerateResult): a PyTorch run whose nodes launch through Accelerate
- launch.py: Accelerate's launch on a node: its parser, config and environment, then torchrun
- options.py: %accelerate's and `cmlcluster accelerate`'s options

accelerate is imported only in the workers' launchers: this package loads where it is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    from .run import AccelerateError, AccelerateResult, run_accelerate


__getattr__, __dir__ = _lazy.exports(
    __name__, {"run": ("AccelerateError", "AccelerateResult", "run_accelerate")}, globals()
)

__all__ = ["AccelerateError", "AccelerateResult", "run_accelerate"]
