"""What one Docker worker's container is made of, besides its image: the user it runs as and the
privileges it keeps, its environment, the files it is given before it starts, and its mounts.
Pure functions of the backend's options and the worker's spec; backend.py sends them.
"""

from __future__ import annotations

import io
import os
import re
import sys
import tarfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import ConfigError
from ...wire import CONNECTION_ENV, CONNECTION_FILE_ENV
from ...workers import PACKAGE_DIR, WorkerSpec

DEFAULT_PIDS_LIMIT = 4096  # processes and threads per worker: room for TF's and data loaders' threads
# What sshd (for Horovod, cmlcluster/ssh/sshd.py) needs when the worker runs as root; the rest stay
# dropped. OpenSSH 9.2's privilege separation chroots its pre-auth child into /run/sshd and drops it
# to the sshd user. Measured, a login with one of the three missing fails in that child:
# SYS_CHROOT 'chroot("/run/sshd"): Operation not permitted', SETUID 'setresuid 100: ...', SETGID
# 'setgroups: ...'; with the three it runs commands as root. A worker that is not root needs none:
# its sshd runs as that user, without privilege separation.
ROOT_SSHD_CAPABILITIES = ("SYS_CHROOT", "SETUID", "SETGID")
# A worker's own folder in its container (the connection info, and HOME for a user that is not
# root), put there before it starts: in the container's own layer, gone with it.
WORKER_FOLDER = "/tmp/cmlcluster-{worker_id}"  # noqa: S108 - the container's /tmp, made for this worker
CONNECTION_FILE = "connection.json"


def privileges(uid: int, pids_limit: int | None) -> dict[str, Any]:
    """The container options that bound what a worker may do: every capability dropped (a root
    worker keeps sshd's), no-new-privileges, and at most pids_limit processes and threads."""
    options: dict[str, Any] = {"cap_drop": ["ALL"], "security_opt": ["no-new-privileges:true"]}
    if uid == 0:
        options["cap_add"] = list(ROOT_SSHD_CAPABILITIES)
    if pids_limit is not None:
        options["pids_limit"] = pids_limit
    return options


def environment(spec: WorkerSpec, uid: int) -> dict[str, str]:
    """The container's environment: the spec's, but the connection info, which is a file (files())
    that CONNECTION_FILE_ENV names. The rest is ids, addresses and paths, and the user's env= (theirs
    to keep out of `docker inspect`, as any container's)."""
    folder = WORKER_FOLDER.format(worker_id=spec.worker_id)
    env = {name: value for name, value in spec.env.items() if name != CONNECTION_ENV}
    env[CONNECTION_FILE_ENV] = f"{folder}/{CONNECTION_FILE}"
    if uid != 0:
        # A uid the image may not know has HOME=/ there, which it cannot write (IPython's
        # profile, Keras' and pip's caches go there). env= may choose another.
        env.setdefault("HOME", f"{folder}/home")
    return env


def work_folder(spec: WorkerSpec) -> str:
    """Where a worker works when the session's working folder is not mounted in its container (a path
    of the notebook's machine means nothing there, and Docker would make it, root's)."""
    return WORKER_FOLDER.format(worker_id=spec.worker_id) + "/work"


def files(spec: WorkerSpec, uid: int, gid: int) -> bytes:
    """A tar archive of the worker's folder, extracted at "/" of its container before it starts:
    the folder, its home and its work folder (0700) and the connection info (0600), all the worker
    user's."""
    folder = WORKER_FOLDER.format(worker_id=spec.worker_id).lstrip("/")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in (
            (folder, None),
            (f"{folder}/home", None),
            (f"{folder}/work", None),
            (f"{folder}/{CONNECTION_FILE}", spec.env.get(CONNECTION_ENV, "").encode()),
        ):
            entry = tarfile.TarInfo(name)
            entry.uid, entry.gid, entry.mtime = uid, gid, int(time.time())
            if data is None:
                entry.type, entry.mode = tarfile.DIRTYPE, 0o700
                archive.addfile(entry)
            else:
                entry.mode, entry.size = 0o600, len(data)
                archive.addfile(entry, io.BytesIO(data))
    return buffer.getvalue()


def same_path_mounts(volumes: Mapping[str, str], cwd: str, mount_cwd: bool, host_python: bool) -> dict[str, str]:
    """{host path: "path:mode"} of what containers see at the session's own paths."""
    mounts = {host: binding for host, binding in volumes.items() if binding.rpartition(":")[0] == host}
    if mount_cwd:
        mounts[cwd] = f"{cwd}:rw"
    if host_python:
        # The package, not its parent: a checkout's root may be private (0700) to a worker of another uid.
        for path in (sys.base_prefix, sys.prefix, PACKAGE_DIR):
            if not path.startswith("/usr/"):
                mounts.setdefault(path, f"{path}:ro")
    return mounts


def check_pids_limit(pids_limit: Any) -> int | None:
    if pids_limit is not None and (isinstance(pids_limit, bool) or not isinstance(pids_limit, int) or pids_limit < 1):
        raise ConfigError(f"pids_limit={pids_limit!r}: give the most processes per worker (e.g. 4096), or None")
    return pids_limit


def parse_volumes(volumes: Mapping[str, str] | Iterable[str] | None) -> dict[str, str]:
    """{host: "container[:mode]"} from a mapping or "host:container[:mode]" strings; host paths must exist."""
    parsed: dict[str, str] = {}
    if volumes is None:
        return parsed
    items = volumes.items() if isinstance(volumes, Mapping) else (split_volume(v) for v in volumes)
    for host, target in items:
        if not os.path.isabs(host) or not os.path.exists(host):
            raise ConfigError(f"volumes: {host!r} is not an existing absolute path on this host; create it first")
        parsed[host] = target if target.count(":") else f"{target}:rw"
    return parsed


def parse_user(user: str) -> tuple[int, int]:
    """(uid, gid) of "uid:gid" (numbers: whether it is root must be told here, not in the image)."""
    found = re.fullmatch(r"(\d+):(\d+)", user) if isinstance(user, str) else None
    if found is None:
        raise ConfigError(f"user={user!r}: give numbers, 'uid:gid' (e.g. '1000:1000'); the default is this process's")
    return int(found[1]), int(found[2])


def split_volume(volume: str) -> tuple[str, str]:
    host, sep, target = volume.partition(":")
    if not sep or not target:
        raise ConfigError(f"volumes: {volume!r} should be 'host path:container path[:ro]'")
    return host, target
