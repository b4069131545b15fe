"""A real Slurm cluster for the tests: Debian's Slurm 22.05 in containers on this machine, with this
machine as its submit host.

start_slurm() makes everything it needs in a private temp folder (slurmtest-*, not cmlcluster-*, which the
leak checks watch) and owns all of it:

- a munge key and a private `munged` on this host whose socket lies in that folder; slurm.conf names it
  (`AuthInfo=socket=...`), so neither this machine's /etc/munge and /run/munge nor its /etc/slurm are read
  or written (every Slurm command is given SLURM_CONF: `cluster.env`);
- a user-defined bridge network of its own, and on it a controller container (slurmctld) and N node
  containers (slurmd), each with its own hostname and IP. They are the bare test image
  (scripts/docker_engine.sh) with this machine's /usr and Python environment bind-mounted read-only
  (sshhosts.host_mounts), so the daemons are this machine's own Slurm binaries and a job's tasks run the
  session's interpreter; the temp folder is mounted at the same path, which gives the daemons slurm.conf
  and munged's socket (one munged serves the whole cluster: they all share its key).

This host submits: `srun`, `sbatch`, `squeue`, `scancel` run here with `cluster.env` added to their
environment. A task on a node reaches this host at `cluster.gateway` (the network's gateway), which is
also the address slurmd dials back to for srun's I/O.

Settings that make Slurm run in these containers: no cgroups (`proctrack/linuxproc`, `task/none`,
`jobacct_gather/none`), no accounting (`accounting_storage/none`: no sacct, as on many sites), no rlimit
propagation (a container's limits are not the submitter's), the configured CPUs and memory rather than
what slurmd detects (`SlurmdParameters=config_overrides`: every container sees the whole machine),
`select/cons_tres` with `CR_Core_Memory` and a `DefMemPerCPU`, so that jobs share nodes by cores and
memory as on a GPU cluster, and `batch_sched_delay=0`, so that sbatch jobs start at once. GPUs without
GPUs: Slurm 22.05 drops count-only GPUs (slurmd registers none and the node goes INVAL), so each node
container gets character devices made with mknod (/run/fakegpu/nvidiaN, NVIDIA's major 195) that
gres.conf's `File=` names; a `--gres=gpu:1` task then sees CUDA_VISIBLE_DEVICES and SLURM_JOB_GPUS.

Containers carry sshhosts' container label and owner-pid label besides their own (`cmlcluster.slurmtest`):
the per-test leak check leaves them to their owner (a cluster may serve a whole run), and whichever
harness starts next removes them once their owner is gone. munged is started with a parent-death signal
(setpriv --pdeathsig), so it ends with the thread that called start_slurm() even if close() never runs:
call start_slurm() from a thread that outlives the cluster (pytest's main thread does).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cmlcluster.backends.base import run_tag_labels
from harness.sshhosts import CONTAINER_LABEL as TEST_HOST_LABEL
from harness.sshhosts import IMAGE, host_mounts
from harness.sshhosts import OWNER_LABEL as TEST_HOST_OWNER_LABEL

SLURM_LABEL = "cmlcluster.slurmtest"  # containers and networks of a test Slurm cluster
OWNER_LABEL = "cmlcluster.slurmtest.pid"  # the test process that started it
FOLDER_PREFIX = "slurmtest-"  # not cmlcluster-*: the leak checks watch those
OWNER_FILE = "owner.pid"  # in the folder: the pid that owns it, for removing a dead owner's folder
START_TIMEOUT = 60.0
SLURMCTLD = "/usr/sbin/slurmctld"
MUNGED = "/usr/sbin/munged"  # by path: /usr/sbin may not be on a user's PATH
DAEMONS = ("slurmctld", "slurmd", "slurmstepd")
FAKE_GPU_DIR = "/run/fakegpu"
NVIDIA_MAJOR = 195
SPOOL_CTLD = "/var/spool/slurmctld"
SPOOL_SLURMD = "/var/spool/slurmd"
LOG_DIR = "/var/log/slurm"

# Runs as root at container start; the daemons are started later by docker exec (start_slurm).
START_SCRIPT = f"""\
set -eu
mkdir -p {SPOOL_CTLD} {SPOOL_SLURMD} {LOG_DIR}
chmod 1777 /tmp
for link in $ALTERNATIVES; do mkdir -p /etc/alternatives; ln -sfn "${{link#*=}}" "/etc/alternatives/${{link%%=*}}"; done
if [ -n "$SUBMIT_USER" ]; then echo "$SUBMIT_USER" >> /etc/passwd; echo "$SUBMIT_GROUP" >> /etc/group; fi
i=0
while [ "$i" -lt "$GPUS" ]; do
    mkdir -p {FAKE_GPU_DIR}
    mknod -m 666 {FAKE_GPU_DIR}/nvidia$i c {NVIDIA_MAJOR} $i
    i=$((i + 1))
done
echo ready
exec sleep infinity
"""


def slurm_installed() -> bool:
    """Whether this machine has Debian's Slurm (scripts/install.sh dev installs it)."""
    return all(shutil.which(tool) for tool in (SLURMCTLD, "/usr/sbin/slurmd", MUNGED, "srun", "sinfo"))


@dataclass
class SlurmNode:
    """One container: the controller or a node (a slurmd named `name`, at `ip`)."""

    name: str
    ip: str
    container_id: str
    _container: Any = field(default=None, repr=False, compare=False)

    def exec(self, *argv: str, env: dict[str, str] | None = None, user: str = "root") -> subprocess.CompletedProcess:
        """Run argv in the container (docker exec, no shell); output captured as text."""
        code, (out, err) = self._container.exec_run(list(argv), environment=env, user=user, demux=True)
        return subprocess.CompletedProcess(
            list(argv), code, (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace")
        )

    def remove(self) -> None:
        from docker.errors import NotFound

        with contextlib.suppress(NotFound):
            self._container.remove(force=True)


@dataclass
class SlurmCluster:
    """A cluster from start_slurm(): run Slurm's commands on this host with `env` added."""

    env: dict[str, str]  # {"SLURM_CONF": conf}: add to a submitting process's environment
    conf: str  # slurm.conf, in `folder`
    folder: str  # the private temp folder (the key, munged's socket and files, slurm.conf, gres.conf)
    controller: SlurmNode
    nodes: list[SlurmNode]
    gateway: str  # this machine's address on the network: tasks on the nodes reach the session there
    network: str
    partition: str = "debug"
    cpus_per_node: int = 2
    memory_mb_per_node: int = 2000
    gpus_per_node: int = 0
    _client: Any = field(default=None, repr=False, compare=False)
    _munged: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _network_created: bool = field(default=False, repr=False, compare=False)

    def node(self, name: str) -> SlurmNode:
        for n in [self.controller, *self.nodes]:
            if n.name == name:
                return n
        raise KeyError(name)

    def exec(self, node: SlurmNode | str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv in a node's (or the controller's) container, as root; SLURM_CONF set."""
        target = self.node(node) if isinstance(node, str) else node
        return target.exec(*argv, env={**self.env, **(env or {})})

    def submit_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a Slurm command on this host: `base` (os.environ) without the SLURM_* that
        an enclosing allocation would have set, plus `env`."""
        base = dict(os.environ if base is None else base)
        return {**{k: v for k, v in base.items() if not k.startswith("SLURM_")}, **self.env}

    def run(self, *argv: str, timeout: float = 60, check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a command (srun, sbatch, squeue, ...) on this host, the submit host; output captured as text."""
        kwargs.setdefault("env", self.submit_env())
        kwargs.setdefault("cwd", self.folder)  # a path the nodes have too: a job's working directory
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check, **kwargs)

    def states(self) -> dict[str, str]:
        """{node name: sinfo's short state} (idle, mix, alloc, down*, ...)."""
        result = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=15)
        if result.returncode != 0:
            raise RuntimeError(f"sinfo failed: {result.stderr.strip()}")
        return dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())

    def logs(self, lines: int = 40) -> str:
        """The tails of slurmctld's and every slurmd's log, and munged's: for a failure's message."""
        parts = []
        logs = [(self.controller, f"{LOG_DIR}/slurmctld.log"), *[(n, f"{LOG_DIR}/slurmd.log") for n in self.nodes]]
        for n, path in logs:
            with contextlib.suppress(Exception):
                parts.append(f"--- {n.name} {path}\n" + n.exec("tail", "-n", str(lines), path).stdout)
        for name in ("munged.out", "munged.log"):
            with contextlib.suppress(OSError), open(os.path.join(self.folder, name)) as f:
                parts.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(parts)

    def close(self) -> None:
        """Remove the containers and the network, stop munged (the process started here) and remove the folder."""
        if self._client is not None:
            members = [self.controller, *self.nodes] if self.controller else self.nodes
            if members:
                with ThreadPoolExecutor(max_workers=len(members)) as pool:
                    list(pool.map(SlurmNode.remove, members))
            if self._network_created:
                with contextlib.suppress(Exception):
                    self._client.networks.get(self.network).remove()
            self._client.close()
            self._client = None
        if self._munged is not None:
            _stop(self._munged)
            self._munged = None
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_slurm(
    nodes: int = 2,
    cpus_per_node: int = 2,
    memory_mb_per_node: int = 2000,
    gpus_per_node: int = 0,
    *,
    def_mem_per_cpu_mb: int | None = None,
) -> SlurmCluster:
    """Start a controller and `nodes` slurmd containers and return once sinfo here shows every node idle.

    The caller must close() the result (or use it as a context manager). `def_mem_per_cpu_mb`: the memory a
    job that names none gets per CPU (by default the node's memory over its CPUs).
    """
    import docker

    if not slurm_installed():
        raise RuntimeError("Slurm is not installed here (scripts/install.sh dev installs Debian's slurmctld, slurmd)")
    client = docker.from_env(timeout=60, max_pool_size=max(10, nodes + 3))
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    run_id = secrets.token_hex(3)
    conf = os.path.join(folder, "slurm.conf")
    cluster = SlurmCluster(
        env={"SLURM_CONF": conf},
        conf=conf,
        folder=folder,
        controller=None,  # type: ignore[arg-type]  # filled in below, before anything can read it
        nodes=[],
        gateway="",
        network=f"cmlcluster-slurm-{run_id}",
        cpus_per_node=cpus_per_node,
        memory_mb_per_node=memory_mb_per_node,
        gpus_per_node=gpus_per_node,
        _client=client,
    )
    try:
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        _remove_orphans(client)
        cluster._munged = _start_munged(folder)
        labels = {
            SLURM_LABEL: run_id,
            OWNER_LABEL: str(os.getpid()),
            TEST_HOST_LABEL: "slurm",  # the per-test leak check leaves it to its owner, as it does SSH hosts
            TEST_HOST_OWNER_LABEL: str(os.getpid()),  # and sshhosts' orphan removal sees the same owner
            **run_tag_labels(),
        }
        net = client.networks.create(
            cluster.network,
            driver="bridge",
            check_duplicate=True,
            labels={SLURM_LABEL: run_id, OWNER_LABEL: str(os.getpid()), **run_tag_labels()},
        )
        cluster._network_created = True
        cluster.gateway = _gateway(net)
        options = {
            "image": IMAGE,
            "command": ["/bin/sh", "-c", START_SCRIPT],
            "environment": {"GPUS": str(gpus_per_node), "ALTERNATIVES": _alternatives(), **_submit_user()},
            "network": cluster.network,
            "labels": labels,
            "volumes": [*host_mounts(True), f"{folder}:{folder}"],
            "init": True,  # signals reach the daemons, and orphaned job processes are reaped
            "detach": True,
        }
        names = [f"slurm-{run_id}-ctl"] + [f"slurm-{run_id}-n{i}" for i in range(1, nodes + 1)]
        members: dict[str, SlurmNode] = {}

        def start(name: str) -> SlurmNode:
            container = client.containers.run(name=name, hostname=name, **options)
            member = SlurmNode(name=name, ip="", container_id=container.id, _container=container)
            members[name] = member  # registered at once, so close() removes it even if it never comes up
            _wait_ready(member, cluster.network)
            return member

        try:
            with ThreadPoolExecutor(max_workers=len(names)) as pool:
                started = list(pool.map(start, names))
        finally:
            ordered = [members[name] for name in names if name in members]
            cluster.controller = ordered[0] if ordered and ordered[0].name == names[0] else None  # type: ignore[assignment]
            cluster.nodes = [m for m in ordered if m.name != names[0]]
        cluster.controller, cluster.nodes = started[0], started[1:]
        with open(conf, "w") as f:
            f.write(slurm_conf(cluster, def_mem_per_cpu_mb or max(1, memory_mb_per_node // cpus_per_node)))
        if gpus_per_node:
            with open(os.path.join(folder, "gres.conf"), "w") as f:
                f.write(gres_conf(cluster))
        cluster.controller._container.exec_run([SLURMCTLD, "-D"], environment=cluster.env, detach=True)
        # slurmds, and Slurm's commands here, retry a controller that is not up only every second or so.
        _wait_listening(cluster, cluster.controller.ip, 6817)
        for node in cluster.nodes:
            node._container.exec_run(["slurmd", "-D", "-N", node.name], environment=cluster.env, detach=True)
        _wait_idle(cluster)
    except BaseException:
        cluster.close()
        raise
    return cluster


def slurm_conf(cluster: SlurmCluster, def_mem_per_cpu_mb: int) -> str:
    ctl = cluster.controller
    gres = f" Gres=gpu:{cluster.gpus_per_node}" if cluster.gpus_per_node else ""
    lines = [
        f"ClusterName=cml{ctl.name.split('-')[1]}",  # lower case, no dashes: it names files in spool folders
        f"SlurmctldHost={ctl.name}({ctl.ip})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "AuthType=auth/munge",
        f"AuthInfo=socket={cluster.folder}/munge.socket.2",
        "CredType=cred/munge",
        # No cgroups in these containers: processes tracked by parentage, no binding, no accounting.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "PropagateResourceLimits=NONE",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "SlurmdParameters=config_overrides",
        f"DefMemPerCPU={def_mem_per_cpu_mb}",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=batch_sched_delay=0",
        "MpiDefault=none",
        "MailProg=/bin/true",  # none here; the default (/bin/mail) is missing, which slurmctld logs as an error
        "SwitchType=switch/none",
        "ReturnToService=2",
        "KillWait=5",  # SIGTERM to SIGKILL when a job is cancelled or ends (default 30 s)
        "InactiveLimit=0",
        "MinJobAge=300",  # ended jobs stay in squeue -t all for 5 minutes
        f"StateSaveLocation={SPOOL_CTLD}",
        f"SlurmdSpoolDir={SPOOL_SLURMD}",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        f"SlurmctldLogFile={LOG_DIR}/slurmctld.log",
        f"SlurmdLogFile={LOG_DIR}/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    if cluster.gpus_per_node:
        lines.append("GresTypes=gpu")
    for node in cluster.nodes:
        lines.append(
            f"NodeName={node.name} NodeAddr={node.ip} NodeHostname={node.name} CPUs={cluster.cpus_per_node} "
            f"Sockets=1 CoresPerSocket={cluster.cpus_per_node} ThreadsPerCore=1 "
            f"RealMemory={cluster.memory_mb_per_node}{gres} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName={cluster.partition} Nodes={','.join(n.name for n in cluster.nodes)} Default=YES "
        "MaxTime=INFINITE State=UP"
    )
    return "\n".join(lines) + "\n"


def gres_conf(cluster: SlurmCluster) -> str:
    last = cluster.gpus_per_node - 1
    files = f"{FAKE_GPU_DIR}/nvidia[0-{last}]" if last else f"{FAKE_GPU_DIR}/nvidia0"
    return "AutoDetect=off\n" + "".join(f"NodeName={n.name} Name=gpu File={files}\n" for n in cluster.nodes)


def _alternatives() -> str:
    """`name=target ...` for Slurm's programs that Debian installs as links into /etc/alternatives (slurmd
    runs /usr/sbin/slurmstepd, a link to slurmstepd-wlm): the containers have /usr, not this /etc."""
    found = []
    for name in DAEMONS:
        path = f"/usr/sbin/{name}"
        if os.path.islink(path) and os.readlink(path) == f"/etc/alternatives/{name}":
            found.append(f"{name}={os.path.realpath(path)}")
    return " ".join(found)


def _submit_user() -> dict[str, str]:
    """passwd and group lines for the containers when this process is not root: slurmd runs a job's tasks
    as the submitting uid, which must have an entry there."""
    if os.getuid() == 0:
        return {"SUBMIT_USER": "", "SUBMIT_GROUP": ""}
    import grp
    import pwd

    user, group = pwd.getpwuid(os.getuid()), grp.getgrgid(os.getgid())
    return {
        "SUBMIT_USER": f"{user.pw_name}:x:{user.pw_uid}:{user.pw_gid}::/tmp:/bin/sh",
        "SUBMIT_GROUP": f"{group.gr_name}:x:{group.gr_gid}:",
    }


def _start_munged(folder: str) -> subprocess.Popen:
    """A munged of the cluster's own, in the foreground as a child of this process, everything in `folder`."""
    key = os.path.join(folder, "munge.key")
    subprocess.run(["dd", "if=/dev/urandom", f"of={key}", "bs=1", "count=1024"], check=True, capture_output=True)
    os.chmod(key, 0o400)
    socket_path = os.path.join(folder, "munge.socket.2")
    argv = [
        MUNGED,
        "--foreground",
        "--force",  # as root, and whatever it thinks of the temp folder's parents
        f"--socket={socket_path}",
        f"--key-file={key}",
        f"--pid-file={folder}/munged.pid",
        f"--seed-file={folder}/munged.seed",
        f"--log-file={folder}/munged.log",
    ]
    if shutil.which("setpriv"):
        argv = ["setpriv", "--pdeathsig", "TERM", *argv]  # ends with its parent even if close() never runs
    # Its output to a file, never a pipe that nobody reads (a full pipe would stop it); a session of its
    # own, so that a signal to this process's group does not end it before close().
    with open(os.path.join(folder, "munged.out"), "wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 15
    while not os.path.exists(socket_path):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            err = ""
            for name in ("munged.out", "munged.log"):
                with contextlib.suppress(OSError), open(os.path.join(folder, name)) as f:
                    err += f.read()
            raise RuntimeError(f"munged did not start (exit {process.returncode}):\n{err}")
        time.sleep(0.02)
    return process


def _stop(process: subprocess.Popen) -> None:
    """End munged, the process started here (and only it)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _gateway(net: Any) -> str:
    net.reload()
    for config in (net.attrs.get("IPAM") or {}).get("Config") or []:
        gateway = config.get("Gateway", "")
        if gateway and ":" not in gateway:
            return gateway
    raise RuntimeError(f"network {net.name!r} has no IPv4 gateway")


def _wait_ready(member: SlurmNode, network: str) -> None:
    """Fill in member.ip and wait for the start script's "ready" (its folders and devices made)."""
    container = member._container
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        container.reload()
        if container.status not in ("created", "running"):
            raise RuntimeError(f"{member.name} exited at start:\n{container.logs().decode(errors='replace')}")
        member.ip = container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]
        if member.ip and b"ready" in container.logs(stdout=True, stderr=False):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{member.name} did not get ready:\n{container.logs().decode(errors='replace')}")
        time.sleep(0.05)


def _wait_listening(cluster: SlurmCluster, ip: str, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {ip}:{port}: {e}\n{cluster.logs()}") from e
            time.sleep(0.02)


def _wait_idle(cluster: SlurmCluster) -> None:
    """Wait until sinfo here shows every node idle (slurmctld answers, every slurmd registered)."""
    deadline = time.monotonic() + START_TIMEOUT
    states: dict[str, str] | str = {}
    while time.monotonic() < deadline:
        try:
            states = cluster.states()
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # slurmctld not listening yet
            states = str(e)
        if isinstance(states, dict) and len(states) == len(cluster.nodes) and set(states.values()) == {"idle"}:
            return
        time.sleep(0.05)
    raise RuntimeError(f"Slurm nodes not idle after {START_TIMEOUT:.0f} s: {states}\n{cluster.logs()}")


def _remove_orphans(client: Any) -> None:
    """Remove test clusters (containers, networks, temp folders here) whose test process is gone."""

    def dead(owner: str) -> bool:
        return not owner.isdigit() or not os.path.exists(f"/proc/{owner}")

    for container in client.containers.list(all=True, filters={"label": SLURM_LABEL}):
        if dead(container.labels.get(OWNER_LABEL, "")):
            with contextlib.suppress(Exception):
                container.remove(force=True)
    for net in client.networks.list(filters={"label": SLURM_LABEL}):
        if dead((net.attrs.get("Labels") or {}).get(OWNER_LABEL, "")):
            with contextlib.suppress(Exception):
                net.remove()
    parent = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            if not name.startswith(FOLDER_PREFIX):
                continue
            try:
                with open(os.path.join(path, OWNER_FILE)) as f:
                    owner = f.read().strip()
            except OSError:
                continue  # not one of ours, or still being made
            if dead(owner):
                shutil.rmtree(path, ignore_errors=True)
