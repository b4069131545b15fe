"""run_horovod: workers, passwordless SSH done safely, then horovodrun from the session.

On workers elsewhere (containers, SSH hosts), one worker's agent per host starts
sshd on port 2222, as the worker's user, admitting only this session's key; the
hosts' keys come back over the control plane and are pinned; each host is checked
with paramiko (all of that in ssh_cluster.py); the script is shipped to hosts that
do not see it; then `horovodrun -np N -H host:slots,... -p 2222 -i key ...` runs
here, and every rank's output streams back live, prefixed by its rank. Where
workers would be processes on this machine (the local backend), horovodrun
starts the ranks itself on localhost, without workers or SSH.

With max_restarts=N the run is elastic (horovodrun --host-discovery-script): a worker lost mid-run
is replaced by the job (jobs.Restarts) and made ready like the first ones (ssh_cluster.py), and the
script's hvd.elastic.run resumes from the state the surviving ranks hold (docs/guide/horovod.md,
"Surviving a lost worker"). On this machine horovodrun itself starts a killed rank again.

The session, the run's view, its end and check= are the run skeleton's (runs/skeleton.py: run); the
Horovod framework here is a launcher in the session, the other kind from torchrun's nodes on workers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import IO

from .. import _lifeline, checks
from .._proc import descendants, end_group, python_module
from ..api import get_session, stop_session, use_backend
from ..backends import Backend
from ..errors import ConfigError
from ..events import OutputLine
from ..jobs import Job
from ..lines import CUT_MARK, MAX_LINE_CHARS
from ..progress import output_event
from ..runs.nodes import check_script_args
from ..runs.options import WorkerOptions, worker_options
from ..runs.result import RESULT_LINES_KEPT
from ..runs.skeleton import Framework, run
from ..session import Session
from ..ssh.keys import SessionSSH
from ..ssh.sshd import write_env_file
from ..wire import RANK_ENV_FILE_ENV
from ..workers import user_file
from . import commands
from .elastic import discovery
from .rendezvous import run_key
from .result import HorovodError, HorovodResult
from .ssh_cluster import SSHCluster, ssh_cluster

__all__ = ["HorovodError", "HorovodResult", "run_horovod"]

RANK_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
PROCESS_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.$")
FIRST_FAILURE = re.compile(r"^Process name: (\d+)$", re.M)  # horovodrun's final error; elastic names host[slot]
RANK = "cmlcluster.horovod.rank"
DRIVER = "cmlcluster.horovod.driver"  # horovodrun, with its rendezvous off the other interfaces
WORKER_LOSS_WINDOW = 5.0  # how long a failed horovodrun waits to learn that a worker was lost (see _execute)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What horovodrun needs from the notebook's environment to run on this machine: nothing secret.
DRIVER_VARIABLES = frozenset(
    {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HOME", "TMPDIR", "LANG", "LC_ALL"}
)

log = logging.getLogger(__name__)


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
    env: Mapping[str, str] | None = None,
    backend: str | Backend | None = None,
    session: Session | None = None,
    start_timeout: int = 60,
    ssh_port: int = commands.SSH_PORT,
    reuse: bool = False,
    ship_working_folder: bool = False,
    max_restarts: int = 0,
    collect: str | Sequence[str] | None = None,
    echo: bool = True,
    check: bool = False,
) -> HorovodResult:
    """Run `script args` under horovodrun on this session's workers; return what happened.

    On workers elsewhere (containers, SSH hosts), each host's worker starts sshd for this session's
    key only, and horovodrun runs here over SSH; every rank's output streams back live, prefixed by
    its rank. Where workers would be processes on this machine (the local backend), horovodrun
    starts the ranks itself on localhost, without workers or SSH.

    Parameters
    ----------
    script : str
        The training script's path (relative to the working folder); shipped to hosts that do not
        see it.
    args : Sequence[str], default ()
        The script's arguments.
    np : int | None, default None
        Processes in all, a whole number, 1 or more, at most workers x slots (default: workers x
        slots).
    workers : int | None, default None
        How many workers, 1 or more (default: enough for np, else 1).
    slots : int | None, default None
        Processes per worker, 1 or more (default: its GPUs, or 1).
    cpu : float, default 1
        Cores per worker.
    memory : float, default 1
        Memory per worker, in GB.
    nvidia_gpu : int, default 0
        GPUs per worker.
    env : Mapping[str, str] | None, default None
        Variables for every rank (ranks on other machines get only these and Horovod's own), read by
        each rank from a 0600 file, never on a command line.
    backend : str | Backend | None, default None
        Without `session`: run in a session of its own on this backend, closed when the run ends;
        with reuse, the default session, moved to this backend if it runs no workers. None: the
        default session (cmlcluster.get_session()).
    session : Session | None, default None
        The session to run in.
    start_timeout : int, default 60
        horovodrun's --start-timeout, in whole seconds, 1 or more.
    ssh_port : int, default 2222
        The TCP port sshd listens on in each worker.
    reuse : bool, default False
        Keep the workers (and their sshd) for the next run, and use those of the previous reuse=True
        run (with as many workers). Not with max_restarts or collect.
    ship_working_folder : bool, default False
        Copy the working folder to workers that do not see it.
    max_restarts : int, default 0
        Replace a lost worker (on this machine: start a killed rank again) up to this many times;
        horovodrun's elastic mode, for a script that trains under hvd.elastic.run
        (docs/guide/horovod.md). 0: the first loss fails the run. On workers elsewhere, it needs ranks
        on 2 or more hosts.
    collect : str | Sequence[str] | None, default None
        Paths under the workers' folders ("outputs") whose files come here as each ends
        (launch_workers').
    echo : bool, default True
        Show the run in the session's view: the ranks' and horovodrun's output, and how it ended.
    check : bool, default False
        Raise HorovodError instead of returning a failed result.

    Returns
    -------
    HorovodResult
        What the run did: ok, exit_code, each rank's last lines (output), horovodrun's own
        (driver_output), failed_rank, worker_failure (a worker that ended during the run), hosts,
        argv, duration and restarts.

    Raises
    ------
    ConfigError
        Bad arguments, before any worker starts: slots, workers or np not a whole number, 1 or more,
        or np past workers x slots; cpu, memory or nvidia_gpu out of range; start_timeout not whole
        seconds, 1 or more; ssh_port no TCP port; max_restarts not a whole number, 0 or more, or with
        reuse, or (on workers elsewhere) with fewer than 2 workers; collect with reuse; a script that is
        no file; a bad env or collect entry; Horovod not installed in this Python; backend= with reuse
        while the default session runs workers on another backend. Later: max_restarts with the workers
        on fewer than 2 hosts (known once they run).
    cmlcluster.jobs.JobStartFailed
        A worker did not start; every worker that did was stopped.
    WorkerError
        A worker could not be made ready (its sshd, say).
    HorovodError
        With check=True, the run failed; its `result` is the HorovodResult.
    KeyboardInterrupt
        Ctrl-C: raised again once horovodrun and its ranks were stopped (the workers too, unless kept
        for reuse).

    Examples
    --------
    ::

        result = cmlcluster.run_horovod("train.py", ["--epochs", "3"], np=2)
        result.ok, result.exit_code, result.output[1], result.duration, result.hosts, result.failed_rank
        result = cmlcluster.run_horovod("train.py", np=2, max_restarts=2)  # result.restarts: workers replaced
    """
    # Everything is checked before anything starts: where and how the workers go as for every run.
    commands.check_start_timeout(start_timeout)  # whole seconds: horovodrun's --start-timeout
    options = worker_options(
        cpu=cpu,
        memory=memory,
        nvidia_gpu=nvidia_gpu,
        env=env,
        backend=backend,
        session=session,
        start_timeout=start_timeout,
        max_restarts=max_restarts,
        collect=collect,
        ship_working_folder=ship_working_folder,
        echo=echo,
        check=check,
    )
    slots = slots if slots is not None else max(nvidia_gpu, 1)
    for name, value in (("slots", slots), ("workers", workers), ("np", np)):
        if value is not None and not checks.whole(value, 1):
            raise ConfigError(f"{name}={value!r}: give a whole number, 1 or more")
    if workers is None:
        workers = math.ceil(np / slots) if np else 1
    np = np if np is not None else workers * slots
    if np > workers * slots:
        raise ConfigError(
            f"np={np}: {workers} workers with {slots} slots each hold {workers * slots} processes; "
            "ask for more workers or slots, or fewer processes"
        )
    commands.check_port(ssh_port)
    if max_restarts and reuse:
        raise ConfigError("max_restarts with reuse: an elastic run's workers are its own; leave one of them out")
    if options.collect and reuse:
        raise ConfigError("collect= with reuse: kept workers do not end, so nothing comes home; leave one out")
    horovod = Horovod(user_file(script), check_script_args(args), np, workers, slots, ssh_port, reuse, _horovodrun())
    if session is None and backend is not None and reuse:
        # What is kept for reuse lives in the default session, on this backend.
        options = replace(options, session=_default_session_on(backend), backend=None)
    return run(options, horovod)


class Horovod(Framework[HorovodResult]):
    """A Horovod run: horovodrun, here in the session, reaching its workers itself (over SSH), or starting
    its ranks on this machine where workers would be local processes."""

    run_name = "horovod"

    def __init__(
        self,
        script: str,
        args: list[str],
        np: int,
        workers: int,
        slots: int,
        ssh_port: int,
        reuse: bool,
        horovodrun: list[str],
    ):
        self.script, self.args, self.np, self.workers, self.slots = script, args, np, workers, slots
        self.ssh_port, self.reuse, self.horovodrun = ssh_port, reuse, horovodrun
        self.title = f"run_horovod {os.path.basename(script)}"

    def error(self, result: HorovodResult) -> HorovodError:
        return HorovodError(result)

    def execute(self, session: Session, options: WorkerOptions) -> HorovodResult:
        # Its ranks' lines and reports reach the session's subscribers (the view, stragglers) as torchrun's do,
        # echo or not: echo is whether the run is shown under a title of its own (runs/skeleton.py).
        max_restarts, view = options.max_restarts, session
        cluster: SSHCluster | None = None
        with run_key(session.session_dir, bool(max_restarts)) as key:
            env = {**options.env, **key.rank_env}  # an elastic run's key: in the ranks' 0600 files, never argv
            try:
                capabilities = session.backend.capabilities()
                if capabilities.session_host and not capabilities.own_address:
                    return self._run_here(session, env, key.driver_env, max_restarts, options.start_timeout, view)
                if max_restarts and self.workers < 2:
                    raise ConfigError(f"max_restarts={max_restarts}: {_ONE_HOST}; ask for 2 or more workers")
                shipment = session.ship([self.script], working_folder=options.ship_working_folder)
                cluster = ssh_cluster(
                    session,
                    self.workers,
                    self.slots,
                    options.resources,
                    self.ssh_port,
                    self.reuse,
                    shipment,
                    max_restarts,
                    collect=options.collect,
                )
                if max_restarts and len(cluster.hosts) < 2:
                    raise ConfigError(f"max_restarts={max_restarts}: {_ONE_HOST}; ask for 2 or more workers")
                cluster.set_rank_env(env)  # a file on each host, never a command line (cmlcluster.horovod.rank)
                interfaces, driver_address = capabilities.interfaces, {}
                if not interfaces:
                    # Without --network-interfaces horovodrun probes the hosts' interfaces with a task service on
                    # each, whose command line holds the run's service key: name the one the hosts reported.
                    cluster.interface = cluster.common_interface()
                    interfaces = (cluster.interface,)
                    driver_address = {commands.DRIVER_ADDRESS_ENV: session.controller_ip}
                # The script as each rank finds it, run in its worker's folder (cmlcluster.horovod.rank).
                command = [capabilities.python, "-m", RANK, shipment.names[self.script], *self.args]
                argv = commands.horovodrun_argv(
                    self.np,
                    cluster.hosts,
                    command,
                    ssh_port=self.ssh_port,
                    identity_file=cluster.ssh.identity_file,
                    start_timeout=int(options.start_timeout),
                    network_interfaces=interfaces,
                    horovodrun=self.horovodrun,
                    elastic=_elastic(cluster.discovery.script, self.np, cluster.hosts) if cluster.discovery else None,
                )
                driver_env = {
                    **_remote_driver_env(cluster.ssh),
                    **key.driver_env,
                    **cluster.rendezvous_env,
                    **driver_address,
                }
                return _execute(argv, cluster.hosts, driver_env, view, cluster.job)
            except KeyboardInterrupt:
                kept = self.reuse and cluster is not None and not cluster.job.failed.is_set()
                log.warning(
                    "cmlcluster: interrupted; horovodrun and its ranks were stopped, the workers %s",
                    "kept for reuse" if kept else "stopped",
                )
                raise
            finally:
                if cluster is not None:
                    if self.reuse and cluster.job.failure is None:
                        cluster.end_ranks()  # the workers stay for the next run; what this run started does not
                    else:
                        cluster.close()

    def _run_here(
        self,
        session: Session,
        env: dict[str, str],
        key_env: dict[str, str],
        max_restarts: int,
        start_timeout: float,
        view: Session | None,
    ) -> HorovodResult:
        """Workers would be processes on this machine anyway: horovodrun starts the ranks here."""
        hosts = commands.local_pseudo_hosts(self.np) if max_restarts else [("localhost", self.np)]
        with _local_env_file(session, env) as driver_env, discovery(session.session_dir, hosts, max_restarts) as found:
            argv = commands.horovodrun_argv(
                self.np,
                hosts,
                [sys.executable, "-m", RANK, self.script, *self.args],
                ssh_port=None,
                start_timeout=int(start_timeout),
                network_interfaces=_loopback() if max_restarts else (),
                horovodrun=self.horovodrun,
                elastic=_elastic(found.script, self.np, hosts, max_restarts) if found else None,
            )
            return _execute(argv, hosts, driver_env | key_env, view, elastic=found is not None)


# Horovod's elastic state lives in the ranks that survive: a run on one host has none left to carry it over.
_ONE_HOST = "an elastic run needs ranks on 2 or more hosts, so that the survivors carry the training state over"


def _elastic(script: str, np: int, hosts: list[tuple[str, int]], max_restarts: int = 0) -> commands.ElasticArgs:
    """The survivors train on while a host is lost; each loss is two resets for horovod (without the
    host, then with it again), which it counts on this machine, where no job replaces workers."""
    reset_limit = 2 * max_restarts if max_restarts else None
    return commands.ElasticArgs(script, commands.elastic_min_np(np, hosts), np, reset_limit=reset_limit)


def _loopback() -> tuple[str, ...]:
    """The interface of 127.0.0.1 ("lo" on Linux): an elastic run names its interface, or horovod
    waits for two hosts to find one."""
    import psutil

    found = [
        name for name, addresses in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addresses)
    ]
    return tuple(found[:1])


def _remote_driver_env(ssh: SessionSSH) -> dict[str, str]:
    """horovodrun's environment when ranks run elsewhere.

    horovodrun copies its whole environment onto every rank's ssh command line, so it gets only
    a neutral PATH and the locale: never the notebook's variables, nor env= (ranks read that from
    a file on their host, see SSHCluster.set_rank_env). Its own ssh is the session's, first on PATH.
    """
    driver = {"PATH": f"{ssh.ssh_wrapper_dir}{os.pathsep}{SYSTEM_PATH}", "PYTHONUNBUFFERED": "1"}
    driver.update({k: os.environ[k] for k in ("LANG", "LC_ALL") if k in os.environ})
    return driver


@contextlib.contextmanager
def _local_env_file(session: Session, env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """horovodrun's environment on this machine, naming a 0600 file in the session's folder that ranks
    read (cmlcluster.horovod.rank); the file goes when the run ends.

    horovodrun writes its whole environment on each rank's `env` command line, which `ps` shows every
    user: it gets only what it needs to run and Horovod's own settings (HOROVOD_*). The rest of the
    notebook's environment, and env=, reach the ranks through the file.
    """
    notebook = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    driver = {k: v for k, v in notebook.items() if k in DRIVER_VARIABLES or k.startswith("HOROVOD_")}
    ranks = {k: v for k, v in notebook.items() if k not in driver}
    ranks.update(env)
    fd, path = tempfile.mkstemp(prefix="rank-env-", suffix=".json", dir=session.session_dir)  # 0600
    os.close(fd)
    try:
        write_env_file(path, ranks)
        driver[RANK_ENV_FILE_ENV] = path
        yield driver
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _default_session_on(backend: str | Backend) -> Session:
    """The default session, on `backend`: workers kept for reuse live there, so that the next run finds
    them and stop_session() (or the end of the process) stops them."""
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


def _horovodrun() -> list[str]:
    """horovodrun, run by this interpreter through cmlcluster.horovod.driver (its rendezvous then
    listens on the address the ranks dial only)."""
    if importlib.util.find_spec("horovod") is None:
        raise ConfigError(
            f"Horovod is not installed in this Python ({sys.executable}); build it with scripts/build_horovod.sh "
            "(or pip install horovod against your TensorFlow)"
        )
    return python_module(DRIVER)  # the notebook's folder not on its sys.path


def _execute(
    argv: list[str],
    hosts: list[tuple[str, int]],
    env: dict[str, str],
    view: Session | None,
    job: Job | None = None,
    elastic: bool = False,
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
    _lifeline.guard_stdin(process)
    reader = threading.Thread(target=_read_output, args=(process, result, view), daemon=True)
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
        if view is not None:
            view.drain()  # the ranks' last lines are shown before what follows
    if process.returncode != 0 and job is not None:
        # A killed worker ends its ranks' ssh connections, and so horovodrun, about as soon as the
        # session hears the worker ended: wait for that news before saying what failed.
        job.failed.wait(WORKER_LOSS_WINDOW)
    result.worker_failure = job.failure if job is not None else None
    result.exit_code = process.returncode
    if job is not None:
        result.restarts = job.restarts
    elif elastic:  # horovodrun started each failed rank again, but the last when the run failed
        failed = [line for line in result.driver_output if (m := PROCESS_EXIT.match(line)) and m.group(2) != "0"]
        result.restarts = max(len(failed) - (result.exit_code != 0), 0)
    result.duration = time.monotonic() - started
    if result.exit_code != 0:
        first = FIRST_FAILURE.findall("\n".join(result.driver_output))
        if first:
            result.failed_rank = int(first[-1])
        elif result.rank_exit_codes:
            result.failed_rank = min(result.rank_exit_codes)
    return result


def _read_output(process: subprocess.Popen[str], result: HorovodResult, view: Session | None) -> None:
    """Collect horovodrun's output into `result`; publish it (ranks' reports as Progress) to `view`."""
    assert process.stdout is not None
    ranks: dict[int, deque[str]] = {}
    driver: deque[str] = deque(maxlen=RESULT_LINES_KEPT)
    try:
        for line in _lines(process.stdout):
            match = RANK_LINE.match(line)
            if match:
                rank, stream, text = int(match.group(1)), match.group(2), match.group(3)
                event = output_event(f"rank {rank}", stream, text)
                if isinstance(event, OutputLine):
                    ranks.setdefault(rank, deque(maxlen=RESULT_LINES_KEPT)).append(text)
                if view is not None:
                    view.publish(event)
                continue
            exited = PROCESS_EXIT.match(line)
            if exited:
                result.rank_exit_codes[int(exited.group(1))] = int(exited.group(2))
            driver.append(line)
            if view is not None:
                view.publish(OutputLine("horovodrun", "stdout", line))
    finally:
        result.output = {rank: list(lines) for rank, lines in sorted(ranks.items())}
        result.driver_output = list(driver)


def _lines(stream: IO[str]) -> Iterator[str]:
    """The stream's lines, without their newline, each cut at MAX_LINE_CHARS (a rank that prints one
    endless line would otherwise be read whole into memory)."""
    cut = False
    for chunk in iter(lambda: stream.readline(MAX_LINE_CHARS), ""):
        ended = chunk.endswith("\n")
        if cut:
            cut = not ended  # the rest of a line already cut
            continue
        if not ended and len(chunk) >= MAX_LINE_CHARS:
            cut = True
            yield chunk + CUT_MARK
            continue
        yield chunk.rstrip("\n")


def _stop(process: subprocess.Popen[str], grace: float = 5.0) -> None:
    """horovodrun and its ranks here, each TERMed (horovodrun may never pass it on); remote ones die with ssh."""
    end_group(process, grace, others=lambda: descendants(process.pid))
