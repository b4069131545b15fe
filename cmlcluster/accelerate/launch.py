"""Accelerate's launch on one node of a run_accelerate run:

    python -m cmlcluster.accelerate.launch REPORT SETTINGS [HOST:PORT TIMEOUT] -- [torchrun's arguments...]

Accelerate's own ``accelerate launch`` code decides each process's environment: its parser reads the
user's launch arguments (SETTINGS' "launch_args": --mixed_precision, --config_file, FSDP's, ...) with
this node's place in the run (machine rank, machines, processes, the main process's address), its
checks fill in what a config file says, and its multi-GPU launcher's environment (ACCELERATE_*, FSDP_*)
is what the ranks get. Then torchrun runs as in a PyTorch run (cmlcluster.pytorch.launch, with its
failure report and rendezvous), which is what Accelerate's launcher runs too; on CPUs Accelerate's
processes use Gloo (ACCELERATE_USE_CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

# Accelerate's launch arguments that run_accelerate sets itself: the run's shape is cmlcluster's.
TOPOLOGY = (
    "--num_machines",
    "--num_processes",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
    "--same_network",
    "--rdzv_backend",
    "--multi_gpu",
    "--cpu",
)
# What accelerate would otherwise warn that it chose for the user.
DEFAULTS = {"--mixed_precision": "no", "--dynamo_backend": "no"}


def launch_argv(settings: dict[str, Any]) -> list[str]:
    """`accelerate launch`'s arguments for this node (the script is a stand-in: torchrun's arguments name it)."""
    given = settings["launch_args"]
    argv = [*given]
    for option, value in DEFAULTS.items():
        if not any(a == option or a.startswith(option + "=") for a in given):
            argv += [option, value]
    if not any(a in ("--use_fsdp", "--config_file") for a in given):
        argv.append("--multi_gpu")  # its launcher is torchrun's, on GPUs or not
    nnodes, nproc = settings["nnodes"], settings["nproc_per_node"]
    return [
        *argv,
        "--num_machines", str(nnodes),
        "--num_processes", str(nnodes * nproc),
        "--machine_rank", str(settings["node_rank"] or 0),
        "--main_process_ip", settings["master_addr"],
        "--main_process_port", "0",  # Accelerate's port check is torchrun's to make: 0 skips it
        "script.py",
    ]  # fmt: skip


def accelerate_env(settings: dict[str, Any]) -> dict[str, str]:
    """The variables Accelerate's multi-GPU launcher gives its processes, for this node."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(launch_argv(settings))
    args, _, _ = _validate_launch_command(args)
    env = {name: value for name, value in prepare_multi_gpu_env(args).items() if os.environ.get(name) != value}
    for name in ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        env.pop(name, None)  # torchrun's arguments, the worker's GPUs and its cores decide these
    if settings["cpu"]:
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def main(argv: list[str]) -> None:
    from cmlcluster.pytorch import launch

    report, settings = argv[0], json.loads(argv[1])

    def configure(torchrun_args: argparse.Namespace) -> None:
        os.environ.update(accelerate_env(settings))

    launch.main([report, *argv[2:]], configure=configure)


if __name__ == "__main__":
    main(sys.argv[1:])
