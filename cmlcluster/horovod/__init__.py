"""Horovod on cmlcluster workers: passwordless SSH done safely, horovodrun, the %horovod magic.

Horovod itself is imported only by training scripts; this package needs paramiko
and cryptography, and horovodrun on PATH.
"""

from .commands import (
    SSH_PORT,
    horovodrun_argv,
    hostfile_text,
    hosts_arg,
    mpirun_argv,
)
from .run import HorovodError, HorovodResult, run_horovod

__all__ = [
    "SSH_PORT",
    "HorovodError",
    "HorovodResult",
    "horovodrun_argv",
    "hostfile_text",
    "hosts_arg",
    "mpirun_argv",
    "run_horovod",
]
