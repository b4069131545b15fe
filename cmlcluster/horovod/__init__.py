"""Horovod on cmlcluster workers: passwordless SSH done safely, horovodrun, the %horovod magic.

Horovod itself is imported only by training scripts; this package needs paramiko
and cryptography, and horovodrun on PATH.
"""

from .commands import (
    SSH_PORT,
    horovodrun_argv,
    hostfile_text,
    hosts_arg,
    known_hosts_text,
    mpirun_argv,
    ssh_config_text,
)
from .run import HorovodError, HorovodResult, check_hosts, run_horovod

__all__ = [
    "SSH_PORT",
    "HorovodError",
    "HorovodResult",
    "check_hosts",
    "horovodrun_argv",
    "hostfile_text",
    "hosts_arg",
    "known_hosts_text",
    "mpirun_argv",
    "run_horovod",
    "ssh_config_text",
]
