"""JAX multi-process training on cmlcluster workers: run_jax, and the %jaxrun magic.

- run.py: run_jax and what it returns (JaxResult), a framework on the run skeleton (cmlcluster.runs)
- node.py: one node on its worker: one JAX process, with Kubeflow's JAX runtime's variables
- process.py: that process: jax.distributed.initialize() finds the run; Gloo's collectives on CPUs
- options.py: %jaxrun's and `cmlcluster jaxrun`'s options

jax itself is imported only in the workers' processes: this package loads where JAX is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    from .run import JaxError, JaxResult, run_jax


__getattr__, __dir__ = _lazy.exports(__name__, {"run": ("JaxError", "JaxResult", "run_jax")}, globals())

__all__ = ["JaxError", "JaxResult", "run_jax"]
