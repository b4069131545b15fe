"""PyTorch distributed training on cmlcluster workers: run_torch, and the %torchrun magic.

torch itself is imported only inside the workers' processes (and by init_process_group,
which they call); this package loads where PyTorch is not installed. The session's side
(run_torch and what it returns) is imported when first used: every rank imports this
package, and needs none of it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .commands import DIST_BACKENDS

if TYPE_CHECKING:
    from .result import RankFailure, TorchError, TorchResult
    from .run import run_torch


def __getattr__(name: str) -> Any:
    if name == "run_torch":
        from .run import run_torch as value
    elif name in ("RankFailure", "TorchError", "TorchResult"):
        from . import result

        value = getattr(result, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # found here from now on
    return value


def init_process_group(**kwargs: Any) -> None:
    """torch.distributed.init_process_group with the backend this run chose (CMLCLUSTER_DIST_BACKEND:
    NCCL on GPUs, Gloo on CPUs); on NCCL, this process's GPU is cuda:LOCAL_RANK first.

    Called in a training script started by run_torch / %torchrun; kwargs go to torch as they are.
    """
    import torch
    import torch.distributed as dist

    backend = kwargs.pop("backend", None) or os.environ.get("CMLCLUSTER_DIST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, **kwargs)


__all__ = ["DIST_BACKENDS", "RankFailure", "TorchError", "TorchResult", "init_process_group", "run_torch"]
