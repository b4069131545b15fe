"""CML's worker API as `cml.workers_v1` has it, on cmlcluster's default session (cmlcluster.api)."""

from cmlcluster.api import await_workers, launch_workers, list_workers, stop_workers

__all__ = ["await_workers", "launch_workers", "list_workers", "stop_workers"]
