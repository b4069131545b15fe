"""What a PyTorch run returns (TorchResult), and raises with it (TorchError)."""

from __future__ import annotations

from dataclasses import dataclass

from ..runs.result import NodesResult, RankFailure, RunError


@dataclass(repr=False)
class TorchResult(NodesResult):
    """What a PyTorch run did: its exit code, every rank's output, which rank failed and why."""

    launcher = "torchrun"
    job = "PyTorch job"


class TorchError(RunError):
    """run_torch(check=True) failed; `result` is its TorchResult."""


__all__ = ["RankFailure", "TorchError", "TorchResult"]
