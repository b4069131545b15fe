"""A TensorFlow cluster's layout, as pure builders: from task addresses to a ClusterSpec dict and each task's TF_CONFIG.

Nothing here starts anything or imports TensorFlow, so every rule is tested
without processes; tests check the results against tf.train.ClusterSpec and
TFConfigClusterResolver.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import checks
from ..errors import ConfigError

DEFAULT_PORT = 2323  # Cloudera's run_cluster; never 2222, where workers run sshd
SSH_PORT = 2222
JOBS = ("chief", "worker", "ps")  # the order TF_CONFIG writers conventionally use

ClusterDict = dict[str, list[str]]


@dataclass(frozen=True)
class Task:
    """One TensorFlow task: its job, its index in the job, its address and any environment of its own."""

    job: str
    index: int
    address: str
    env: Mapping[str, str] = field(default_factory=dict)


def check_counts(n_workers: int, n_ps: int, min_workers: int | None = None) -> int:
    """Validate the task counts before anything starts; return the effective min_workers."""
    if not checks.whole(n_workers, 1):
        raise ConfigError(f"n_workers={n_workers!r}: a cluster needs at least 1 worker task")
    if not checks.whole(n_ps, 0):
        raise ConfigError(f"n_ps={n_ps!r}: the number of parameter servers must be 0 or more")
    if min_workers is None:
        return n_workers
    if not checks.whole(min_workers, 1, n_workers):
        raise ConfigError(f"min_workers={min_workers!r}: give a number from 1 to n_workers ({n_workers})")
    return min_workers


def check_restarts(max_restarts: int, coordinator: bool, stable_addresses: bool) -> None:
    """Whether this cluster can take back lost workers (max_restarts, a whole number, was checked with the
    other worker options)."""
    if not max_restarts:
        return
    if not coordinator:
        raise ConfigError(
            f"max_restarts={max_restarts}: only a cluster this process coordinates takes a lost worker back "
            "(start_cluster(..., coordinator=True) with ParameterServerStrategy); TF_CONFIG scripts "
            "(MultiWorkerMirroredStrategy) and TF1 sessions stop with their first lost task"
        )
    if not stable_addresses:
        raise ConfigError(
            f"max_restarts={max_restarts}: TensorFlow takes a lost worker back only at its address, which "
            "this backend cannot give a replacement (a pod's address is the cluster's to choose; a shared Docker "
            "network= was not made with its range given); use the local, ssh or docker backend (with its own "
            "session network), or max_restarts=0"
        )


def check_port(port: int, what: str = "port") -> int:
    if not checks.port(port):
        raise ConfigError(f"{what}={port!r}: give a TCP port from 1 to 65535 (the default is {DEFAULT_PORT})")
    if port == SSH_PORT:
        raise ConfigError(f"{what}={port}: port {SSH_PORT} is sshd's in every worker; use another, e.g. {DEFAULT_PORT}")
    return port


def assign_ports(ips: Sequence[str], port: int = DEFAULT_PORT) -> list[int]:
    """A port for each task: `port` for a task alone on its IP; tasks sharing an IP get port, port+1, ...

    Port 2222 is skipped: it is sshd's in every worker.
    """
    check_port(port)
    next_port: dict[str, int] = {}
    ports = []
    for ip in ips:
        candidate = next_port.get(ip, port)
        if candidate == SSH_PORT:
            candidate += 1
        if candidate > 65535:
            raise ConfigError(f"port={port}: too many tasks share {ip} to give each a port from {port} up")
        ports.append(candidate)
        next_port[ip] = candidate + 1
    return ports


def split_address(address: str) -> tuple[str, int]:
    """ "10.0.0.2:2323" -> ("10.0.0.2", 2323); "[::1]:2323" works too."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"address {address!r}: write it as host:port, e.g. 10.0.0.2:{DEFAULT_PORT}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass  # a host name
    return f"{host}:{port}"


def cluster_spec(ps: Sequence[str] = (), workers: Sequence[str] = (), chief: Sequence[str] = ()) -> ClusterDict:
    """The ClusterSpec dict {"ps": [...], "worker": [...]} ("chief" only when given).

    Refuses a worker-less cluster, malformed addresses and two tasks on one address.
    """
    if not workers and not chief:
        raise ConfigError("a cluster needs at least one worker (or chief) address")
    if len(chief) > 1:
        raise ConfigError(f"chief={list(chief)!r}: a cluster has at most one chief")
    spec: ClusterDict = {}
    if chief:
        spec["chief"] = list(chief)
    if workers:
        spec["worker"] = list(workers)
    if ps:
        spec["ps"] = list(ps)
    every = [a for job in spec.values() for a in job]
    for address in every:
        check_port(split_address(address)[1], what=f"the port of {address}")
    clashes = sorted(a for a, count in Counter(every).items() if count > 1)
    if clashes:
        raise ConfigError(
            f"{', '.join(clashes)}: two tasks on one address; give each task sharing an IP its own port "
            "(assign_ports does)"
        )
    return spec


def spec_from_tasks(tasks: Sequence[Task]) -> ClusterDict:
    by_job: dict[str, list[Task]] = {}
    for task in tasks:
        by_job.setdefault(task.job, []).append(task)
    for job, members in by_job.items():
        if job not in JOBS:
            raise ConfigError(f"job {job!r}: TensorFlow tasks are 'chief', 'worker' or 'ps'")
        if sorted(t.index for t in members) != list(range(len(members))):
            raise ConfigError(f"job {job!r}: task indexes must be 0..{len(members) - 1}")

    def addresses(job: str) -> list[str]:
        return [t.address for t in sorted(by_job.get(job, []), key=lambda t: t.index)]

    return cluster_spec(ps=addresses("ps"), workers=addresses("worker"), chief=addresses("chief"))


def tf_config(spec: Mapping[str, Sequence[str]], task_type: str, task_index: int) -> dict[str, Any]:
    """The TF_CONFIG of one task (json.dumps it into the task's environment)."""
    if task_type not in spec:
        raise ConfigError(f"task_type={task_type!r}: the cluster has jobs {', '.join(spec)}")
    if not checks.whole(task_index, 0, len(spec[task_type]) - 1):
        raise ConfigError(f"task_index={task_index!r}: job {task_type!r} has tasks 0..{len(spec[task_type]) - 1}")
    return {
        "cluster": {job: list(addresses) for job, addresses in spec.items()},
        "task": {"type": task_type, "index": task_index},
    }


def session_address(spec: Mapping[str, Sequence[str]]) -> str:
    """Where a TF1-style client session connects: the first worker's (or the chief's) server."""
    first = spec["chief"][0] if spec.get("chief") else spec["worker"][0]
    return f"grpc://{first}"


def per_gpu_layout(hosts: Sequence[str], gpus_per_host: int, port: int = DEFAULT_PORT) -> list[Task]:
    """The AWS/Rescale layout: on every host one parameter server, and one worker per GPU.

    The parameter server takes `port`; worker g on a host takes the next free port and
    sees only GPU g (CUDA_VISIBLE_DEVICES), so tasks on one host never share a GPU or a port.
    """
    if not hosts:
        raise ConfigError("hosts=[]: give at least one host")
    if not checks.whole(gpus_per_host, 1):
        raise ConfigError(f"gpus_per_host={gpus_per_host!r}: give the number of GPUs on each host, 1 or more")
    duplicates = sorted(h for h, count in Counter(hosts).items() if count > 1)
    if duplicates:
        raise ConfigError(f"hosts: {', '.join(duplicates)} listed twice; list each host once")
    tasks: list[Task] = []
    for h, host in enumerate(hosts):
        ps_port, *worker_ports = assign_ports([host] * (gpus_per_host + 1), port)
        tasks.append(Task("ps", h, join_address(host, ps_port)))
        for g, worker_port in enumerate(worker_ports):
            tasks.append(
                Task("worker", h * gpus_per_host + g, join_address(host, worker_port), {"CUDA_VISIBLE_DEVICES": str(g)})
            )
    spec_from_tasks(tasks)  # refuses anything inconsistent
    return tasks
