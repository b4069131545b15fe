"""run_horovod: workers, passwordless SSH done safely, then horovodrun from the session.

On workers with their own addresses (Docker), every worker's agent starts sshd on
port 2222 admitting only this session's key; the workers' host keys come back over
the control plane and are pinned; each host is checked with paramiko; then
`horovodrun -np N -H ip:slots,... -p 2222 -i key ...` runs here, and every rank's
output streams back live, prefixed by its rank. On the local backend horovodrun
starts the ranks itself on localhost, without workers or SSH.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import _lifeline
from .._proc import signal_group
from ..backends import Backend
from ..errors import CmlClusterError, ConfigError
from ..jobs import Job, JobFailure, Member
from ..session import Session
from . import commands
from .keys import SessionSSH

RANK_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
PROCESS_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.$")
FIRST_FAILURE = re.compile(r"Process name: (\d+)")  # in horovodrun's final error
SSHD = "cmlcluster.horovod.sshd"
CHECK_TIMEOUT = 10.0

log = logging.getLogger("cmlcluster")


@dataclass
class HorovodResult:
    """What a Horovod run did: its exit code, every rank's output, which rank failed and why."""

    exit_code: int
    hosts: list[tuple[str, int]]
    argv: list[str]
    duration: float
    output: dict[int, list[str]] = field(default_factory=dict)  # rank -> lines
    driver_output: list[str] = field(default_factory=list)  # horovodrun's own lines
    rank_exit_codes: dict[int, int] = field(default_factory=dict)  # non-zero ones horovodrun reported
    failed_rank: int | None = None
    worker_failure: JobFailure | None = None  # a worker that ended during the run (killed, crashed)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def __repr__(self) -> str:
        ranks = len(self.output)
        state = "ok" if self.ok else f"failed (rank {self.failed_rank})"
        return (
            f"<HorovodResult {state} exit_code={self.exit_code} ranks={ranks} {self.duration:.1f} s hosts={self.hosts}>"
        )

    @property
    def message(self) -> str:
        if self.ok:
            return f"horovodrun succeeded: {sum(s for _, s in self.hosts)} slots on {len(self.hosts)} hosts"
        if self.worker_failure is not None:
            return (
                f"the Horovod job failed: {self.worker_failure}; horovodrun, its ranks and every other worker "
                "were stopped"
            )
        if self.failed_rank is None:
            tail = "\n".join(self.driver_output[-20:])
            return f"horovodrun exited with code {self.exit_code}:\n{tail}"
        code = self.rank_exit_codes.get(self.failed_rank)
        tail = "\n".join(self.output.get(self.failed_rank, [])[-20:])
        return (
            f"rank {self.failed_rank} exited with code {code}; horovodrun stopped the other ranks. "
            f"Its last output:\n{tail}"
        )


class HorovodError(CmlClusterError):
    def __init__(self, result: HorovodResult):
        super().__init__(result.message)
        self.result = result


def run_horovod(
    script: str,
    args: Sequence[str] = (),
    *,
    np: int | None = None,
    workers: int | None = None,
    slots: int | None = None,
    cpu: float = 1,
    memory: float = 1,
    nvidia_gpu: int = 0,
    backend: str | None = None,
    session: Session | None = None,
    start_timeout: int = 60,
    ssh_port: int = commands.SSH_PORT,
    reuse: bool = False,
    echo: bool = True,
    check: bool = False,
) -> HorovodResult:
    """Run `script args` under horovodrun on this session's workers; return what happened.

    np: processes in all (default: workers x slots). workers: how many workers (default: enough
    for np). slots: processes per worker (default: its GPUs, or 1). reuse: keep the workers (and
    their sshd) for the next run, and use those of the previous reuse=True run. check: raise
    HorovodError instead of returning a failed result.
    """
    # Everything is checked before anything starts.
    slots = slots if slots is not None else max(nvidia_gpu, 1)
    for name, value in (("slots", slots), ("workers", workers), ("np", np)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r}: give a whole number, 1 or more")
    if workers is None:
        workers = math.ceil(np / slots) if np else 1
    np = np if np is not None else workers * slots
    if np > workers * slots:
        raise ConfigError(
            f"np={np}: {workers} workers with {slots} slots each hold {workers * slots} processes; "
            "ask for more workers or slots, or fewer processes"
        )
    if not os.path.isfile(script):
        raise ConfigError(f"script={script!r}: no such file; give the path of the training script")
    script = os.path.abspath(script)
    horovodrun = _horovodrun()
    owned = session is None and backend is not None and not reuse
    if session is None:
        session = _session_for(backend, reuse)
    cluster: SSHCluster | None = None
    try:
        if session.backend.name == "local":
            hosts = [("localhost", np)]
            argv = commands.horovodrun_argv(
                np,
                hosts,
                [sys.executable, script, *args],
                ssh_port=None,
                start_timeout=start_timeout,
                horovodrun=horovodrun,
            )
            return _execute(argv, hosts, os.environ.copy(), echo, check)
        cluster = _ssh_cluster(session, workers, slots, cpu, memory, nvidia_gpu, ssh_port, reuse)
        argv = commands.horovodrun_argv(
            np,
            cluster.hosts,
            [session.backend.worker_python(), script, *args],
            ssh_port=ssh_port,
            identity_file=cluster.ssh.identity_file,
            start_timeout=start_timeout,
            network_interfaces=session.backend.worker_interfaces(),
            horovodrun=horovodrun,
        )
        env = dict(os.environ, PATH=f"{cluster.ssh.ssh_wrapper_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        return _execute(argv, cluster.hosts, env, echo, check, cluster.job)
    except KeyboardInterrupt:
        kept = "kept for reuse" if reuse and cluster is not None and not cluster.job.failed.is_set() else "stopped"
        log.warning("cmlcluster: interrupted; horovodrun and its ranks were stopped, the workers %s", kept)
        raise
    finally:
        if cluster is not None:
            if reuse and cluster.job.failure is None:
                cluster.end_ranks()  # the workers stay for the next run; what this run started does not
            else:
                cluster.close()
        if owned:
            session.close()


def _session_for(backend: str | Backend | None, reuse: bool) -> Session:
    """The default session; or, for backend= without reuse, a session of its own (closed after the run).

    Workers kept for reuse live in the default session, so that the next run finds them and
    stop_session() (or the end of the process) stops them.
    """
    from ..api import get_session, stop_session, use_backend

    if backend is None:
        return get_session()
    if not reuse:
        return Session(backend)
    session = get_session()
    same = session.backend is backend or (isinstance(backend, str) and session.backend.name == backend)
    if not same:
        if any(w["status"] not in ("stopped", "succeeded", "failed") for w in session.list_workers()):
            raise ConfigError(
                f"backend={backend!r} with reuse: the default session runs workers on {session.backend.name!r}; "
                "call cmlcluster.stop_session() first, or run without reuse"
            )
        stop_session()  # only finished workers in it: nothing is lost
        use_backend(backend)
        session = get_session()
    return session


def _horovodrun() -> str:
    """The horovodrun of this interpreter's environment (a venv's bin is often not on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    found = beside if os.access(beside, os.X_OK) else shutil.which("horovodrun")
    if not found:
        raise ConfigError(
            "horovodrun is not installed in this environment; build Horovod with scripts/build_horovod.sh "
            "(or pip install horovod against your TensorFlow)"
        )
    return found


@dataclass
class SSHCluster:
    """Workers with sshd running and pinned, ready for horovodrun or mpirun; one job."""

    session: Session
    hosts: list[tuple[str, int]]
    ssh: SessionSSH
    job: Job

    @property
    def worker_ids(self) -> list[str]:
        return self.job.worker_ids

    def end_ranks(self) -> None:
        """End what runs on the workers through sshd (ranks a failed or interrupted run left); sshd stays."""
        with contextlib.suppress(Exception):
            if not self.session.closed:
                self.session.call_each([(w, f"{SSHD}:end_sessions", ()) for w in self.worker_ids], timeout=30)

    def close(self) -> None:
        self.job.finish()
        with contextlib.suppress(Exception):
            if not self.session.closed:
                self.session.stop_workers(*self.worker_ids)
        self.ssh.close()
        if _reusable.get(self.session.id) is self:
            del _reusable[self.session.id]


_reusable: dict[str, SSHCluster] = {}


def _ssh_cluster(
    session: Session, n: int, slots: int, cpu: float, memory: float, gpus: int, port: int, keep: bool
) -> SSHCluster:
    previous = _reusable.get(session.id)
    if previous is not None and keep:
        if len(previous.worker_ids) == n and previous.job.failure is None and previous.hosts:
            previous.hosts = [(host, slots) for host, _ in previous.hosts]
            return previous
        previous.close()
    launched = session.launch_workers(n, cpu, memory, gpus)
    ssh = SessionSSH.create(parent=session.session_dir)
    ids = [w["id"] for w in launched if "id" in w]
    job = Job(session, [Member(w, "host", i) for i, w in enumerate(ids)], "Horovod job")
    cluster = SSHCluster(session, [], ssh, job)
    try:
        ready = session.await_workers(launched, wait_for_completion=False, timeout_seconds=120)
        if ready["failures"]:
            reasons = "\n".join(f"  {f.get('id', '?')}: {f.get('message') or f['status']}" for f in ready["failures"])
            raise CmlClusterError(f"{len(ready['failures'])} of {n} Horovod workers did not start:\n{reasons}")
        up = ready["workers"]
        host_keys = session.call_each([(w["id"], f"{SSHD}:start", (ssh.public_key, port)) for w in up])
        ssh.pin({w["ip_address"]: key for w, key in zip(up, host_keys, strict=True)}, port)
        check_hosts([w["ip_address"] for w in up], port, ssh.identity_file, ssh.known_hosts)
        cluster.hosts = [(w["ip_address"], slots) for w in up]
    except BaseException:
        cluster.close()
        raise
    if keep:
        _reusable[session.id] = cluster
    return cluster


def check_hosts(hosts: Sequence[str], port: int, identity_file: str, known_hosts: str) -> None:
    """Log in to every host at once with paramiko, the session key and the pinned host keys.

    Raises one error listing every host that cannot be reached, with its reason.
    """
    import paramiko

    def try_host(host: str) -> str | None:
        client = paramiko.SSHClient()
        client.load_host_keys(known_hosts)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(
                host,
                port=port,
                username="root",
                key_filename=identity_file,
                look_for_keys=False,
                allow_agent=False,
                timeout=CHECK_TIMEOUT,
                banner_timeout=CHECK_TIMEOUT,
                auth_timeout=CHECK_TIMEOUT,
            )
            _, stdout, _ = client.exec_command("true", timeout=CHECK_TIMEOUT)
            if stdout.channel.recv_exit_status() != 0:
                return "logged in, but cannot run commands"
            return None
        except paramiko.BadHostKeyException:
            return "its host key is not the one pinned for this session (refusing: possible impostor)"
        except paramiko.SSHException as e:
            return f"SSH refused: {e}"
        except OSError as e:
            return f"cannot connect to port {port}: {e.strerror or e}"
        finally:
            client.close()

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        problems = {h: p for h, p in zip(hosts, pool.map(try_host, hosts), strict=True) if p}
    if problems:
        listing = "\n".join(f"  {host}:{port}: {why}" for host, why in problems.items())
        raise CmlClusterError(f"{len(problems)} of {len(hosts)} Horovod hosts cannot be reached by SSH:\n{listing}")


def _execute(
    argv: list[str], hosts: list[tuple[str, int]], env: dict[str, str], echo: bool, check: bool, job: Job | None = None
) -> HorovodResult:
    result = HorovodResult(exit_code=-1, hosts=hosts, argv=argv, duration=0.0)
    started = time.monotonic()
    env.pop("PYTEST_CURRENT_TEST", None)
    # Under a lifeline: if this process is killed, horovodrun dies too, and its helpers end the ranks.
    process = subprocess.Popen(
        [sys.executable, _lifeline.__file__, "--", *argv],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    reader = threading.Thread(target=_read_output, args=(process, result, echo), daemon=True)
    reader.start()
    try:
        while process.poll() is None:
            if job is not None and job.failed.is_set():
                _stop(process)  # a worker is gone: its ranks with it, so the others would only wait
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.1)  # short waits, so Ctrl-C reaches this thread
    except BaseException:
        _stop(process)
        raise
    finally:
        reader.join(5)
        assert process.stdin is not None
        process.stdin.close()
    result.worker_failure = job.failure if job is not None else None
    result.exit_code = process.returncode
    result.duration = time.monotonic() - started
    if result.exit_code != 0:
        first = FIRST_FAILURE.findall("\n".join(result.driver_output))
        if first:
            result.failed_rank = int(first[-1])
        elif result.rank_exit_codes:
            result.failed_rank = min(result.rank_exit_codes)
    if echo and not result.ok:
        print(f"[horovod] {result.message}", file=sys.stderr, flush=True)
    if check and not result.ok:
        raise HorovodError(result)
    return result


def _read_output(process: subprocess.Popen[str], result: HorovodResult, echo: bool) -> None:
    assert process.stdout is not None
    for raw in process.stdout:
        line = raw.rstrip("\n")
        match = RANK_LINE.match(line)
        if match:
            rank, stream, text = int(match.group(1)), match.group(2), match.group(3)
            result.output.setdefault(rank, []).append(text)
            if echo:
                print(f"[rank {rank}] {text}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)
            continue
        exited = PROCESS_EXIT.match(line)
        if exited:
            result.rank_exit_codes[int(exited.group(1))] = int(exited.group(2))
        result.driver_output.append(line)
        if echo:
            print(f"[horovodrun] {line}", flush=True)


def _stop(process: subprocess.Popen[str], grace: float = 5.0) -> None:
    """horovodrun and the ranks it started here (its process group); remote ranks die with their ssh."""
    signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        signal_group(process.pid, signal.SIGKILL)
        process.wait()
