"""Pure builders for a PyTorch run: how many processes per node, which process-group backend,
torchrun's argv (static, or elastic), and the rank label of a line of torchrun's output. Nothing
here runs anything."""

from __future__ import annotations

import re
from collections.abc import Sequence

from .. import checks
from ..errors import ConfigError
from . import rendezvous

DIST_BACKENDS = ("gloo", "nccl", "mpi", "ucc")  # what torch.distributed.init_process_group accepts
DEFAULT_JOIN_TIMEOUT = 120  # seconds for every node to reach the rendezvous
# torchrun --tee prefixes what a local process writes with its role and local rank: "[default1]:".
TEE_HEADER = re.compile(r"\[default(\d+)\]:")
# Each process's first line, on stdout and stderr (rank.py): its ranks in this round of the run.
RANK_MARKER = "@cmlcluster-rank"
RANK_MARKER_LINE = re.compile(re.escape(RANK_MARKER) + r" (\d+) (\d+) (\d+) (\d+)$")  # rank local group restart
# An elastic run's nodes tell the rendezvous they live every interval; a node silent for interval x
# attempts seconds is dropped from it, and only then can its replacement join (torch's default: 5 x 3,
# 15 s). A node that trains on is not disturbed by being dropped: only the next round would miss it.
KEEP_ALIVE_INTERVAL = 1
KEEP_ALIVE_MAX_ATTEMPT = 5


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


def elastic_torchrun_args(
    *,
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    local_addr: str,
    max_restarts: int,
    join_timeout: float,
    log_dir: str,
    entry: Sequence[str],
) -> list[str]:
    """torchrun's arguments for one node of an elastic run whose rendezvous store is at `endpoint`.

    Every node is a client of that store (is_host=false): it lives in the session, so losing any
    node leaves it. Always nnodes nodes (N:N): the run waits for a lost node's replacement rather
    than going on smaller, so the world size, and the loss, are those of an undisturbed run. Each
    node restarts its processes up to max_restarts times (once per lost peer). local_addr is the
    address peers dial (the process group's MASTER_ADDR when this node is rank 0's). The run id and
    the run's signing key are not here: they go in the environment (elastic_env), where no other user
    of the host reads them, as every process's command line is read (ps). The backend is torch's c10d
    one with its state signed (rendezvous.py).
    """
    conf = {
        "is_host": "false",
        "join_timeout": int(join_timeout),
        "keep_alive_interval": KEEP_ALIVE_INTERVAL,
        "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPT,
    }
    return [
        "--nnodes", f"{nnodes}:{nnodes}",
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", rendezvous.BACKEND,
        "--rdzv-endpoint", endpoint,
        "--rdzv-conf", ",".join(f"{key}={value}" for key, value in conf.items()),
        "--max-restarts", str(max_restarts),
        "--local-addr", local_addr,
        "--tee", "3",
        "--log-dir", log_dir,
        *entry,
    ]  # fmt: skip


def elastic_env(run_id: str, key: str) -> dict[str, str]:
    """The environment that carries an elastic node's secrets to torchrun: its run id (torchrun's own
    PET_RDZV_ID, for --rdzv-id) and the key that signs the rendezvous state (hex)."""
    return {rendezvous.RUN_ID_ENV: run_id, rendezvous.KEY_ENV: key}


class TeedLines:
    """Whole lines, each with its global rank, from torchrun's teed output, one output line at a time.

    torchrun's tail thread writes each readline() of a process's log behind its header, and
    readline() returns part of a line when the process has written only part of it (an
    unbuffered print writes its text and its newline apart): "[default1]:script finished"
    then "[default1]:\n" arrive as one line, "[default1]:script finished[default1]:". So a
    header may come mid-line, and a process's line ends only at a newline after its own header.
    The header names the local rank; its global rank is in the process's first line, its rank
    marker (swallowed here), since an elastic run gives a process of a new round a new rank. Until
    a marker comes, a static run's numbering holds: node_rank x nproc_per_node + local rank.
    """

    def __init__(self, node_rank: int | None, nproc_per_node: int):
        self.first_rank = None if node_rank is None else node_rank * nproc_per_node
        self.ranks: dict[int, int] = {}  # local rank -> global rank, from its latest marker
        self.partial: dict[int, str] = {}  # local rank -> its line so far

    def rank_of(self, local_rank: int) -> int | None:
        if local_rank in self.ranks:
            return self.ranks[local_rank]
        return None if self.first_rank is None else self.first_rank + local_rank

    def feed(self, line: str) -> list[tuple[int | None, str]]:
        """(global rank, text) of each line that ends here; rank None for torchrun's own lines."""
        headers = list(TEE_HEADER.finditer(line))
        if not headers:
            return [(None, line)]
        lines: list[tuple[int | None, str]] = []
        if headers[0].start() > 0:  # torchrun's own text before a process's
            lines.append((None, line[: headers[0].start()]))
        for header, after in zip(headers, [*headers[1:], None], strict=True):
            local_rank = int(header.group(1))
            text = self.partial.pop(local_rank, "") + line[header.end() : after.start() if after else None]
            if after is not None:
                self.partial[local_rank] = text  # the next header came before this line's newline
                continue
            marker = RANK_MARKER_LINE.search(text)
            if marker is None:
                lines.append((self.rank_of(local_rank), text))
                continue
            if marker.start() > 0:  # the unfinished line of this local rank's process of the last round
                lines.append((self.rank_of(local_rank), text[: marker.start()]))
            self.ranks[local_rank] = int(marker.group(1))
        return lines

    def flush(self) -> list[tuple[int | None, str]]:
        """The parts of lines left when the output ends."""
        lines = [(self.rank_of(local), text) for local, text in sorted(self.partial.items())]
        self.partial.clear()
        return lines
