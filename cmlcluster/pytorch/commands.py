"""Pure builders for a PyTorch run: how many processes per node, which process-group backend,
torchrun's argv, and the rank label of a line of torchrun's output. Nothing here runs anything."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .. import checks
from ..errors import ConfigError

DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc")  # what torch.distributed.init_process_group accepts
DEFAULT_JOIN_TIMEOUT = 120  # seconds for every node to reach the rendezvous
# torchrun --tee prefixes what a local process writes with its role and local rank: "[default1]:".
TEE_HEADER = re.compile(r"\[default(\d+)\]:")
RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$", re.DOTALL)  # how a rank's line reaches the session


def nproc_for(nproc_per_node: int | str, nvidia_gpu: int) -> int:
    """Processes per node: "auto" is one per GPU of the worker, or 1 without GPUs."""
    if nproc_per_node == "auto":
        return max(nvidia_gpu, 1)
    if isinstance(nproc_per_node, str) or not checks.whole(nproc_per_node, 1):
        raise ConfigError(f"nproc_per_node={nproc_per_node!r}: give a whole number, 1 or more, or 'auto'")
    if nvidia_gpu and nproc_per_node > nvidia_gpu:
        raise ConfigError(
            f"nproc_per_node={nproc_per_node} with nvidia_gpu={nvidia_gpu}: each process of a GPU job needs a GPU "
            "of its own; ask for more GPUs per worker, or leave nproc_per_node='auto'"
        )
    return nproc_per_node


def dist_backend_for(dist_backend: str | None, nvidia_gpu: int) -> str:
    """NCCL on GPUs, Gloo on CPUs, unless the user names one."""
    if dist_backend is None:
        return "nccl" if nvidia_gpu else "gloo"
    if dist_backend not in DIST_BACKENDS:
        raise ConfigError(f"dist_backend={dist_backend!r}: give one of {', '.join(DIST_BACKENDS)}, or None for auto")
    if dist_backend == "nccl" and not nvidia_gpu:
        raise ConfigError("dist_backend='nccl' needs GPUs: pass nvidia_gpu=N, or use 'gloo' on CPUs")
    return dist_backend


def threads_per_process(cpu: float, nproc: int) -> int:
    """OMP_NUM_THREADS for each process: the worker's cores shared out (torchrun would say 1)."""
    return max(1, int(cpu // nproc))


def torchrun_args(
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    join_timeout: float,
    log_dir: str,
    entry: Sequence[str],
) -> list[str]:
    """torchrun's arguments for one node of a static rendezvous at master_addr:master_port.

    Every process's output is teed (so that each line names its process); no restarts: a
    failed process fails the run, as it fails a Horovod or TensorFlow job.
    """
    return [
        "--nnodes", str(nnodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(nproc_per_node),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--rdzv-conf", f"timeout={int(join_timeout)}",
        "--max-restarts", "0",
        "--tee", "3",
        "--log-dir", log_dir,
        *entry,
    ]  # fmt: skip


class TeedLines:
    """Whole lines, each with its global rank, from torchrun's teed output, one output line at a time.

    torchrun's tail thread writes each readline() of a process's log behind its header, and
    readline() returns part of a line when the process has written only part of it (an
    unbuffered print writes its text and its newline apart): "[default1]:script finished"
    then "[default1]:\n" arrive as one line, "[default1]:script finished[default1]:". So a
    header may come mid-line, and a process's line ends only at a newline after its own header.
    A static rendezvous numbers ranks node by node: node_rank x nproc_per_node + local rank.
    """

    def __init__(self, node_rank: int, nproc_per_node: int):
        self.first_rank = node_rank * nproc_per_node
        self.partial: dict[int, str] = {}  # global rank -> its line so far

    def feed(self, line: str) -> list[tuple[int | None, str]]:
        """(global rank, text) of each line that ends here; rank None for torchrun's own lines."""
        headers = list(TEE_HEADER.finditer(line))
        if not headers:
            return [(None, line)]
        lines: list[tuple[int | None, str]] = []
        if headers[0].start() > 0:  # torchrun's own text before a process's
            lines.append((None, line[: headers[0].start()]))
        for header, after in zip(headers, [*headers[1:], None], strict=True):
            rank = self.first_rank + int(header.group(1))
            text = self.partial.pop(rank, "") + line[header.end() : after.start() if after else None]
            if after is None:
                lines.append((rank, text))
            else:
                self.partial[rank] = text  # the next header came before this line's newline
        return lines

    def flush(self) -> list[tuple[int | None, str]]:
        """The parts of lines left when the output ends."""
        lines: list[tuple[int | None, str]] = sorted(self.partial.items())
        self.partial.clear()
        return lines


def parse_rank_line(text: str) -> tuple[int, str] | None:
    """(rank, text) of a line as the session receives it, "[rank 3] text"; None for other lines."""
    match = RANK_LINE.match(text)
    return (int(match.group(1)), match.group(2)) if match else None


def check_script_args(args: Any) -> list[str]:
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"args={args!r}: a script's arguments are a list of strings, e.g. ['--epochs', '3']")
    return list(args)
