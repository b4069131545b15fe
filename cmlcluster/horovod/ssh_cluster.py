"""Workers made ready for horovodrun: one sshd per host, admitting only this session's key, pinned.

One worker's agent per host starts sshd on port 2222 (cmlcluster.ssh.sshd), as the worker's
user; the hosts' keys come back over the control plane and are pinned; each host is checked
with paramiko; shipped files are unpacked where sshd starts the ranks. A cluster kept for
reuse serves the session's next run.

An elastic cluster (max_restarts > 0) lists its hosts in a DiscoveryFile for horovodrun instead:
a lost worker's host leaves the list at once, and its replacement (launched by the job) is made
ready as the first hosts were, then listed.

Each host's worker also reports its own interface addresses (sshd.start); they go to a file that
horovodrun's rendezvous reads (rendezvous.HOSTS_FILE_ENV, rendezvous_env), rewritten before the
discovery list whenever the hosts change: a rank may dial the rendezvous from any of them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import CmlClusterError, WorkerError
from ..events import Event, JobChanged, JobState, Member
from ..jobs import Job, Restarts, Role, launch_job
from ..runs.skeleton import send_files
from ..session import Session
from ..shipping import Shipment
from ..ssh.config import SshdAnswer, sshd_answer
from ..ssh.keys import SessionSSH
from ..ssh.preflight import Login, check_logins
from ..workers import Resources
from . import commands, rendezvous
from .elastic import DiscoveryFile

SSHD_MODULE = "cmlcluster.ssh.sshd"
HOST_ADDRESSES_FILE = "host_addresses.json"  # in the session's ssh folder (0700), beside its key


@dataclass
class SSHCluster:
    """Workers with one sshd per host running and pinned, ready for horovodrun or mpirun; one job."""

    session: Session
    hosts: list[tuple[str, int]]  # (address, slots)
    ssh: SessionSSH
    job: Job
    sshd_workers: list[str] = field(default_factory=list)  # one per host, the one whose sshd serves it
    port: int = 2222
    slots: int = 1  # per worker
    shipment: Shipment | None = None
    discovery: DiscoveryFile | None = None  # elastic only
    rank_env: dict[str, str] | None = None  # set_rank_env's, for replacements too (ranks read the file, empty or not)
    interface: str | None = None  # the hosts' interface horovodrun was told (run_horovod): replacements must have it
    _served: dict[str, str] = field(default_factory=dict)  # address -> the worker whose sshd serves it
    _pinned: dict[str, SshdAnswer] = field(default_factory=dict)  # address -> what its sshd said (key, user, ...)
    _gone: set[str] = field(default_factory=set)  # lost workers already taken off the list
    _ids: set[str] = field(default_factory=set)  # every worker this cluster made a host of
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _unsubscribe: Callable[[], None] | None = None

    @property
    def worker_ids(self) -> list[str]:
        return self.job.worker_ids

    @property
    def addresses_file(self) -> str:
        """{host: the addresses of its interfaces, as its worker reported them}, for the rendezvous."""
        return os.path.join(self.ssh.folder, HOST_ADDRESSES_FILE)

    @property
    def rendezvous_env(self) -> dict[str, str]:
        """For horovodrun's driver: where the job's hosts' addresses are (it reads the file at each host change)."""
        return {rendezvous.HOSTS_FILE_ENV: self.addresses_file}

    def set_rank_env(self, env: Mapping[str, str]) -> None:
        """This run's env= for its ranks, in a 0600 file on each host (cmlcluster.ssh.sshd:set_rank_env):
        horovodrun would put the values on every rank's ssh command line, which `ps` shows every user."""
        self.rank_env = dict(env)
        self.session.call_each([(w, f"{SSHD_MODULE}:set_rank_env", (self.rank_env,)) for w in self.sshd_workers])

    def common_interface(self) -> str:
        """The name every host's worker reported for its interface toward the session (commands.common_interface)."""
        with self._lock:
            reported = {a: self._pinned[a].interface for a, _ in self.hosts if a in self._pinned}
        return commands.common_interface(reported)

    def serve(self, members: list[Member]) -> None:
        """Start sshd in one worker per new address (files first), pin their keys, check every login."""
        by_address: dict[str, list[str]] = {}
        for m in members:
            by_address.setdefault(m.address, []).append(m.worker_id)
        new = {a: ids[0] for a, ids in by_address.items() if a not in self._served}
        self._ids.update(m.worker_id for m in members)
        workers = list(new.values())
        if self.shipment is not None:
            send_files(self.session, workers, self.shipment)  # before sshd starts, the first time
        # sshd listens only on the address horovodrun and the session reach the worker at.
        calls = [(w, f"{SSHD_MODULE}:start", (self.ssh.public_key, self.port, a)) for a, w in new.items()]
        # Checked before any of it reaches the session's known_hosts and ssh config (one line per host).
        started = [sshd_answer(w, s) for w, s in zip(workers, self.session.call_each(calls), strict=True)]
        for worker, address, answer in zip(workers, new, started, strict=True):
            if self.interface is not None and answer.interface != self.interface:
                raise WorkerError(
                    f"worker {worker} at {address}: its interface toward the session is {answer.interface or 'none'}, "
                    f"not {self.interface} as the run's other hosts' (horovodrun gives every rank one interface name)",
                    worker,
                )
        if self.rank_env is not None:  # a replacement's: the first hosts get it from run_horovod
            self.session.call_each([(w, f"{SSHD_MODULE}:set_rank_env", (self.rank_env,)) for w in workers])
        with self._lock:
            self._pinned.update(zip(new, started, strict=True))
            keys, users = {a: s.host_key for a, s in self._pinned.items()}, {a: s.user for a, s in self._pinned.items()}
            self.ssh.pin(keys, self.port, users)
        logins = [Login(a, self.port, s.user) for a, s in zip(new, started, strict=True)]
        check_logins(logins, self.ssh.identity_file, self.ssh.known_hosts, what="Horovod hosts")
        with self._lock:
            self._served.update(new)
            self.sshd_workers = list(self._served.values())
            slots = Counter(dict(self.hosts))
            for address, ids in by_address.items():
                slots[address] += self.slots * len(ids)
            self.hosts = list(slots.items())
            self._publish()  # pinned and checked: horovodrun may start ranks there

    def _lose(self, member: Member) -> None:
        """A lost worker's host leaves the discovery list (all of it when its sshd went with it); once."""
        with self._lock:
            if member.worker_id in self._gone or member.worker_id not in self._ids:
                return  # done already, or another job's
            self._gone.add(member.worker_id)
            slots = dict(self.hosts)
            if self._served.get(member.address) == member.worker_id:
                del self._served[member.address]
                self._pinned.pop(member.address, None)
                slots.pop(member.address, None)
            elif member.address in slots:
                slots[member.address] -= self.slots
            self.hosts = [(a, n) for a, n in slots.items() if n > 0]
            self.sshd_workers = list(self._served.values())
            self._publish()

    def _publish(self) -> None:
        """The hosts, for horovodrun (with the lock held): their addresses first, then (elastic) the
        discovery list, so that the rendezvous knows a host's addresses by the time horovod lists it."""
        addresses = {a: self._pinned[a].addresses for a, _ in self.hosts if a in self._pinned}
        rendezvous.write_host_addresses(self.addresses_file, addresses)
        if self.discovery is not None:
            self.discovery.set(self.hosts)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, JobChanged) and event.state == JobState.MEMBER_LOST and event.job == self.job.name:
            for member in event.members:
                self._lose(member)

    def replace(self, lost: Member, new: Member) -> None:
        """The job's Restarts.replace: make the new worker a host like the first ones, then list it."""
        self._lose(lost)  # in case the job's member_lost has not reached _on_event yet
        self.serve([new])

    def end_ranks(self) -> None:
        """End what runs on the workers through sshd (ranks a failed or interrupted run left); sshd stays."""
        with contextlib.suppress(Exception):
            if not self.session.closed:
                self.session.call_each([(w, f"{SSHD_MODULE}:end_sessions", ()) for w in self.sshd_workers], timeout=30)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        try:
            self.job.stop()
        finally:
            self.ssh.close()
            if self.discovery is not None:
                self.discovery.close()
            if _reusable.get(self.session.id) is self:
                del _reusable[self.session.id]


_reusable: dict[str, SSHCluster] = {}


def ssh_cluster(
    session: Session,
    n: int,
    slots: int,
    resources: Resources,
    port: int,
    keep: bool,
    shipment: Shipment,
    max_restarts: int = 0,
    replacement_timeout: float = 120,
    collect: tuple[str, ...] = (),
) -> SSHCluster:
    """n workers with sshd on `port`, `slots` each, the shipment unpacked; the one kept (keep) by the
    session's previous run when it still fits, else new ones (kept for the next run when keep).
    max_restarts: an elastic cluster whose lost workers the job replaces (never kept). collect: paths
    of the workers' folders that come home as each ends (never with keep: kept workers do not end)."""
    previous = _reusable.get(session.id)
    if previous is not None and keep and not max_restarts:
        if len(previous.worker_ids) == n and previous.job.failure is None and previous.hosts:
            send_files(session, previous.sshd_workers, shipment)
            per_host = Counter(m.address for m in previous.job.members)
            previous.hosts = [(host, slots * per_host[host]) for host, _ in previous.hosts]
            return previous
        previous.close()
    ready = threading.Event()
    holder: dict[str, SSHCluster] = {}

    def replace(lost: Member, new: Member) -> None:  # on the job's thread
        if not ready.is_set():
            raise CmlClusterError("the Horovod run was still starting")
        holder["cluster"].replace(lost, new)

    restarts = Restarts(max_restarts, replace, timeout_seconds=replacement_timeout) if max_restarts else None
    role = Role("host", n, resources, replaceable=restarts is not None, collect=collect)
    job = launch_job(session, [role], "Horovod job", timeout_seconds=120, restarts=restarts)
    cluster = holder["cluster"] = SSHCluster(
        session, [], SessionSSH.create(parent=session.session_dir), job, port=port, slots=slots, shipment=shipment
    )
    try:
        if restarts is not None:
            cluster.discovery = DiscoveryFile(parent=cluster.ssh.folder)
            cluster._unsubscribe = session.subscribe(cluster._on_event)
        cluster.serve(list(job.members))
        ready.set()
    except BaseException:
        cluster.close()
        raise
    if keep and not max_restarts:
        _reusable[session.id] = cluster
    return cluster
