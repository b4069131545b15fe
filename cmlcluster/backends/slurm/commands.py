"""What the Slurm backend says to Slurm and reads back, as plain data: each worker's srun command line,
squeue's lines, the nodes' sizes from sinfo, and Slurm's job states in CML's words. Nothing here runs a
command (backend.py does), so all of it is tested without a cluster.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ... import checks
from ...errors import ConfigError
from ...workers import FAILED, STOPPED, Resources, Status

TASK = "cmlcluster.backends.slurm.task"  # what each job step runs on its node: the worker's agent, looked after
JOB_PREFIX = "cmlcluster-"  # every job's name: cmlcluster-<session id>-<worker id>
GANG_PREFIX = "gang-"  # a launch's job: cmlcluster-<session id>-gang-<its first worker's id>
COMMENT_PREFIX = "cmlcluster "  # every job's comment: "cmlcluster session=<id> host=<name> pid=<pid>"
# squeue's fields, "|"-separated: id, name, state, reason, nodes, partition, priority, comment.
SQUEUE_FORMAT = "%i|%j|%T|%r|%N|%P|%Q|%k"
SINFO_FORMAT = "%N|%c|%m|%G|%P"  # node, CPUs, memory (MB), GRES, partition
# How a job that ended without the session asking is reported (the job's state, at its end). A time limit
# fails the worker, named in its message: "timedout" is await_workers' word for a worker not there in time.
ENDED_AS: Mapping[str, Status] = {
    "CANCELLED": STOPPED,  # by its owner or an admin, outside cmlcluster
    "PREEMPTED": STOPPED,
    "TIMEOUT": FAILED,
    "DEADLINE": FAILED,
    "FAILED": FAILED,
    "NODE_FAIL": FAILED,
    "OUT_OF_MEMORY": FAILED,
    "BOOT_FAIL": FAILED,
}
NOT_ENDED = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"})
WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED"})
TIME_LIMIT = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^UNLIMITED$")  # Slurm's --time formats, as a check


@dataclass(frozen=True)
class JobOptions:
    """Where and how long a session's jobs run: what every srun of the session is given.

    partition, account, qos: Slurm's own (the cluster's default where empty). time_limit: each job's
    --time ("30", "2:00:00", "1-00:00:00"); "" is the partition's default. signal_before_end: seconds
    before the time limit when the worker is sent SIGUSR1 (its program may checkpoint); 0: none. gpus:
    how GPUs are asked for: "gres" (--gres=gpu:N, every Slurm) or "gpus-per-node" (--gpus-per-node=N).
    extra: more srun options, each "--name=value", as the site asks (--constraint=..., --reservation=...).
    """

    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit: str = ""
    signal_before_end: int = 0
    gpus: str = "gres"
    extra: tuple[str, ...] = ()


def job_options(
    partition: str = "",
    account: str = "",
    qos: str = "",
    time_limit: str | int = "",
    signal_before_end: int = 0,
    gpus: str = "gres",
    extra: Sequence[str] = (),
) -> JobOptions:
    """JobOptions, each checked: a ConfigError names a bad value and the fix, before anything starts."""
    for name, value in (("partition", partition), ("account", account), ("qos", qos)):
        if not isinstance(value, str) or (value and not re.fullmatch(r"[A-Za-z0-9_.,-]+", value)):
            raise ConfigError(f"{name}={value!r}: give Slurm's name for it (letters, digits, '_', '.', '-')")
    limit = str(time_limit)
    if isinstance(time_limit, bool) or (limit and not TIME_LIMIT.match(limit)):
        raise ConfigError(
            f"time_limit={time_limit!r}: give minutes (30), 'hours:minutes:seconds' ('2:00:00') or "
            "'days-hours:minutes:seconds' ('1-00:00:00'), as sbatch's --time"
        )
    if not checks.whole(signal_before_end, 0) or signal_before_end > 65535:
        raise ConfigError(
            f"signal_before_end={signal_before_end!r}: give the seconds before the time limit when workers "
            "are sent SIGUSR1, 0 (none) to 65535"
        )
    if gpus not in ("gres", "gpus-per-node"):
        raise ConfigError(f"gpus={gpus!r}: give 'gres' (--gres=gpu:N) or 'gpus-per-node' (--gpus-per-node=N)")
    option = re.compile(r"--[a-z][a-z-]*(=.+)?")
    if isinstance(extra, str) or not all(isinstance(o, str) and option.fullmatch(o) for o in extra):
        raise ConfigError(f"extra={extra!r}: give a list of srun options, each '--name=value'")
    return JobOptions(partition, account, qos, limit, signal_before_end, gpus, tuple(extra))


def job_name(session_id: str, worker_id: str) -> str:
    return f"{JOB_PREFIX}{session_id}-{worker_id}"


def job_comment(session_id: str, host: str, pid: int) -> str:
    """What marks a job as a session's: `cmlcluster cleanup` ends a job whose session's process is gone."""
    return f"{COMMENT_PREFIX}session={session_id} host={host} pid={pid}"


def parse_comment(comment: str) -> dict[str, str]:
    """{"session", "host", "pid"} of a job's comment made by job_comment; {} for any other."""
    if not comment.startswith(COMMENT_PREFIX):
        return {}
    fields = dict(part.split("=", 1) for part in comment[len(COMMENT_PREFIX) :].split() if "=" in part)
    return fields if {"session", "host", "pid"} <= fields.keys() else {}


def srun_argv(
    srun: str,
    name: str,
    comment: str,
    resources: Resources,
    options: JobOptions,
    python: str,
    argv: Sequence[str],
) -> list[str]:
    """One worker's srun: a job of one task on one node, with the worker's cores, memory and GPUs, running
    its agent under the task launcher. Nothing secret: the worker's environment reaches it from srun's own
    (--export=ALL), never this command line."""
    command = [srun, *_one_task(name, resources, options), f"--comment={comment}", *_job_limits(options)]
    return [*command, *options.extra, python, "-m", TASK, "--", *argv]


def _job_limits(options: JobOptions) -> list[str]:
    """Where a job of the session runs and for how long, and its warning before the end."""
    command = []
    for flag, value in (("partition", options.partition), ("account", options.account), ("qos", options.qos)):
        if value:
            command.append(f"--{flag}={value}")
    if options.time_limit:
        command.append(f"--time={options.time_limit}")
    if options.signal_before_end:
        command.append(f"--signal=USR1@{options.signal_before_end}")
    return command


def gang_name(session_id: str, first_worker_id: str) -> str:
    """The name of the job that holds one launch's workers (named after the first of them)."""
    return job_name(session_id, f"{GANG_PREFIX}{first_worker_id}")


def salloc_argv(salloc: str, name: str, comment: str, n: int, resources: Resources, options: JobOptions) -> list[str]:
    """The allocation for one launch of n workers, as one job: Slurm grants all n tasks (each with a worker's
    whole cores, memory and GPUs, on as few or many nodes as it likes) at once, or none. Nothing runs in it
    (--no-shell): each worker is a step of it (step_argv) once it is granted. salloc says "Pending job
    allocation N" / "Granted job allocation N" on stderr (GRANTED, SUBMITTED), and exits once granted."""
    cpus = max(1, math.ceil(resources.cpu))
    command = [
        salloc,
        "--no-shell",
        f"--job-name={name}",
        f"--comment={comment}",
        f"--ntasks={n}",
        f"--cpus-per-task={cpus}",
        f"--mem-per-cpu={max(1, math.ceil(resources.memory_mib / cpus))}M",  # a node's share grows with its tasks
    ]
    if resources.nvidia_gpu:
        command.append(f"--gpus-per-task={resources.nvidia_gpu}")  # per task: --gres counts per node
    return [*command, *_job_limits(options), *options.extra]


# What salloc says of the allocation it asked for (Slurm's own messages, stable since 2.x).
SUBMITTED = re.compile(r"(?:Pending|Granted) job allocation (\d+)")
GRANTED = re.compile(r"Granted job allocation (\d+)")


def step_argv(
    srun: str,
    job_id: str,
    name: str,
    resources: Resources,
    options: JobOptions,
    python: str,
    argv: Sequence[str],
    *,
    gang: bool = False,
) -> list[str]:
    """One worker as a step of an allocation: the one the session runs in (a notebook that sbatch,
    batchspawner or Open OnDemand started), where its cores may be the notebook's own step's too (--overlap:
    the notebook mostly waits), with the site's extra options; or its launch's gang job (gang=True), where
    each step has its own task's share and the extra options were the allocation's. The partition, account
    and time limit are the allocation's."""
    command = [srun, f"--jobid={job_id}", *([] if gang else ["--overlap"]), *_one_task(name, resources, options)]
    return [*command, *([] if gang else options.extra), python, "-m", TASK, "--", *argv]


def _one_task(name: str, resources: Resources, options: JobOptions) -> list[str]:
    """One task on one node with the worker's cores (whole ones: Slurm allocates cores), memory and GPUs."""
    command = [
        f"--job-name={name}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={max(1, math.ceil(resources.cpu))}",
        f"--mem={max(1, resources.memory_mib)}M",
        "--export=ALL",
        "--chdir=/tmp",  # the session's folder is not on the node: the launcher makes one of its own
        "--unbuffered",  # lines reach the session as they are written
        "--kill-on-bad-exit=1",
        "--quiet",
    ]
    if resources.nvidia_gpu:
        flag = "--gres=gpu:" if options.gpus == "gres" else "--gpus-per-node="
        command.append(f"{flag}{resources.nvidia_gpu}")
    return command


@dataclass(frozen=True)
class QueuedJob:
    """One line of squeue: a job, its state and why it waits (Slurm's reason), where it runs."""

    job_id: str
    name: str
    state: str
    reason: str
    nodes: str
    partition: str
    priority: int
    comment: str


def parse_squeue(text: str) -> list[QueuedJob]:
    """squeue -h -o SQUEUE_FORMAT's lines; a line that is not one is left out."""
    jobs = []
    for line in text.splitlines():
        parts = line.split("|", 7)
        if len(parts) != 8:
            continue
        job_id, name, state, reason, nodes, partition, priority, comment = (p.strip() for p in parts)
        rank = int(priority) if priority.isdigit() else 0
        jobs.append(QueuedJob(job_id, name, state, reason, nodes, partition, rank, comment))
    return jobs


def jobs_ahead(job: QueuedJob, queue: Iterable[QueuedJob]) -> int:
    """How many pending jobs of its partition Slurm considers before `job`: higher priority, or as high
    and submitted earlier (a smaller id)."""

    def key(j: QueuedJob) -> tuple[int, int]:
        return (-j.priority, int(j.job_id) if j.job_id.isdigit() else 0)

    return sum(
        1
        for other in queue
        if other.job_id != job.job_id
        and other.state == "PENDING"
        and other.partition == job.partition
        and key(other) < key(job)
    )


def waiting_reason(job: QueuedJob, ahead: int) -> str:
    """What the session says of a job that waits: Slurm's state and reason, and the jobs ahead of it."""
    reason = f" ({job.reason})" if job.reason and job.reason != "None" else ""
    queue = f", {ahead} job{'s' if ahead != 1 else ''} ahead in partition {job.partition}" if ahead else ""
    return f"Slurm job {job.job_id} {job.state}{reason}{queue}"


@dataclass(frozen=True)
class NodeSize:
    """A node as sinfo sees it: its name, cores, memory (MB) and GPUs, and its partitions."""

    name: str
    cpus: int
    memory_mb: int
    gpus: int
    partition: str


def parse_sinfo(text: str) -> list[NodeSize]:
    """sinfo -h -N -o SINFO_FORMAT's lines."""
    nodes = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 5 or not parts[1].isdigit():
            continue
        name, cpus, memory, gres, partition = parts
        memory_mb = int(re.sub(r"\D.*", "", memory) or 0)
        gpus = sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:(,]+)?:(\d+)", gres))
        nodes.append(NodeSize(name, int(cpus), memory_mb, gpus, partition.rstrip("*")))
    return nodes


def check_fits(resources: Resources, nodes: Sequence[NodeSize], partition: str) -> None:
    """ConfigError when no node of the partition (the default one where "") could ever hold one worker."""
    in_partition = [n for n in nodes if not partition or n.partition == partition]
    if not in_partition:
        known = sorted({n.partition for n in nodes})
        raise ConfigError(f"partition={partition!r}: this Slurm cluster has no such partition; give one of {known}")
    cores, memory = max(1, math.ceil(resources.cpu)), resources.memory_mib
    if any(n.cpus >= cores and n.memory_mb >= memory and n.gpus >= resources.nvidia_gpu for n in in_partition):
        return
    biggest = max(in_partition, key=lambda n: (n.gpus, n.cpus, n.memory_mb))
    where = f"partition {partition!r}" if partition else "the cluster"
    raise ConfigError(
        f"a worker with cpu={resources.cpu:g}, memory={resources.memory:g} GB and nvidia_gpu={resources.nvidia_gpu} "
        f"fits no node of {where} (the largest, {biggest.name}: {biggest.cpus} cores, {biggest.memory_mb} MB, "
        f"{biggest.gpus} GPUs); ask for less, or another partition="
    )


def check_gang_fits(n: int, resources: Resources, nodes: Sequence[NodeSize], partition: str) -> None:
    """ConfigError when the partition's nodes, all free, could not hold n such workers at once: a launch's
    gang job would wait for ever (Slurm queues it all the same)."""
    cores, memory, gpus = max(1, math.ceil(resources.cpu)), max(1, resources.memory_mib), resources.nvidia_gpu
    room = sum(
        min(n.cpus // cores, n.memory_mb // memory, n.gpus // gpus if gpus else n.cpus)
        for n in nodes
        if not partition or n.partition == partition
    )
    if room < n:
        where = f"partition {partition!r}" if partition else "the cluster"
        raise ConfigError(
            f"{n} workers with cpu={resources.cpu:g}, memory={resources.memory:g} GB and nvidia_gpu={gpus} are one "
            f"Slurm job (gang=True: all of them at once), and the whole of {where} holds at most {room} of them: "
            "launch fewer, ask for less, or give gang=False for a job each, each starting as a place frees"
        )


def controller_host(config: str) -> str:
    """slurmctld's address from `scontrol show config`: "SlurmctldHost[0] = name(address)" or "= name"."""
    match = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", config, re.M)
    if not match:
        raise ConfigError("scontrol show config names no SlurmctldHost: is this machine a Slurm submit host?")
    return match.group(2) or match.group(1)
