"""Workers made ready for horovodrun: one sshd per host, admitting only this session's key, pinned.

One worker's agent per host starts sshd on port 2222 (cmlcluster.ssh.sshd), as the worker's
user; the hosts' keys come back over the control plane and are pinned; each host is checked
with paramiko; shipped files are unpacked where sshd starts the ranks. A cluster kept for
reuse serves the session's next run.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..jobs import Job, Role, launch_job
from ..runs import send_files
from ..session import Session
from ..shipping import Shipment
from ..ssh.keys import SessionSSH
from ..ssh.preflight import Login, check_logins
from ..workers import Resources

SSHD_MODULE = "cmlcluster.ssh.sshd"


@dataclass
class SSHCluster:
    """Workers with one sshd per host running and pinned, ready for horovodrun or mpirun; one job."""

    session: Session
    hosts: list[tuple[str, int]]  # (address, slots)
    ssh: SessionSSH
    job: Job
    sshd_workers: list[str] = field(default_factory=list)  # one per host, the one whose sshd serves it

    @property
    def worker_ids(self) -> list[str]:
        return self.job.worker_ids

    def set_rank_env(self, env: Mapping[str, str]) -> None:
        """This run's env= for its ranks, in a 0600 file on each host (cmlcluster.ssh.sshd:set_rank_env):
        horovodrun would put the values on every rank's ssh command line, which `ps` shows every user."""
        self.session.call_each([(w, f"{SSHD_MODULE}:set_rank_env", (dict(env),)) for w in self.sshd_workers])

    def end_ranks(self) -> None:
        """End what runs on the workers through sshd (ranks a failed or interrupted run left); sshd stays."""
        with contextlib.suppress(Exception):
            if not self.session.closed:
                self.session.call_each([(w, f"{SSHD_MODULE}:end_sessions", ()) for w in self.sshd_workers], timeout=30)

    def close(self) -> None:
        try:
            self.job.stop()
        finally:
            self.ssh.close()
            if _reusable.get(self.session.id) is self:
                del _reusable[self.session.id]


_reusable: dict[str, SSHCluster] = {}


def ssh_cluster(
    session: Session, n: int, slots: int, resources: Resources, port: int, keep: bool, shipment: Shipment
) -> SSHCluster:
    """n workers with sshd on `port`, `slots` each, the shipment unpacked; the one kept (keep) by the
    session's previous run when it still fits, else new ones (kept for the next run when keep)."""
    previous = _reusable.get(session.id)
    if previous is not None and keep:
        if len(previous.worker_ids) == n and previous.job.failure is None and previous.hosts:
            send_files(session, previous.sshd_workers, shipment)
            per_host = Counter(m.address for m in previous.job.members)
            previous.hosts = [(host, slots * per_host[host]) for host, _ in previous.hosts]
            return previous
        previous.close()
    job = launch_job(session, [Role("host", n, resources)], "Horovod job", timeout_seconds=120)
    cluster = SSHCluster(session, [], SessionSSH.create(parent=session.session_dir), job)
    try:
        # Workers that share an address (several on one SSH host) share one sshd, started in the first.
        by_address: dict[str, list[str]] = {}
        for m in job.members:
            by_address.setdefault(m.address, []).append(m.worker_id)
        cluster.sshd_workers = [ids[0] for ids in by_address.values()]
        send_files(session, cluster.sshd_workers, shipment)  # before sshd starts, the first time
        addresses = list(by_address)
        # sshd listens only on the address horovodrun and the session reach the worker at.
        started = session.call_each(
            [
                (w, f"{SSHD_MODULE}:start", (cluster.ssh.public_key, port, address))
                for w, address in zip(cluster.sshd_workers, addresses, strict=True)
            ]
        )
        cluster.ssh.pin(
            {a: s["host_key"] for a, s in zip(addresses, started, strict=True)},
            port,
            {a: s["user"] for a, s in zip(addresses, started, strict=True)},
        )
        logins = [Login(a, port, s["user"]) for a, s in zip(addresses, started, strict=True)]
        check_logins(logins, cluster.ssh.identity_file, cluster.ssh.known_hosts, what="Horovod hosts")
        cluster.hosts = [(a, slots * len(ids)) for a, ids in by_address.items()]
    except BaseException:
        cluster.close()
        raise
    if keep:
        _reusable[session.id] = cluster
    return cluster
