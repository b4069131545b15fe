"""Workers as data: what was asked (WorkerSpec), what is known (Worker), CML's dict shape.

A WorkerSpec is frozen and complete: a backend needs nothing else to start the
worker's process. A Worker is the session's record of one worker; only the
session's loop thread mutates it.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from . import checks, wire
from .apps import ports as app_ports
from .errors import ConfigError, WorkerError

# The folder that holds this cmlcluster package: first on the PYTHONPATH of workers that see it,
# so that they import the session's cmlcluster, installed or not.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(PACKAGE_PARENT, "cmlcluster")  # the package itself


class Text(str, Enum):
    """An enum whose members are their strings: equal to them ("running" == Status.RUNNING) and written as
    them (str(), f-strings, JSON), as CML's dicts and the events' readers have them."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Status(Text):
    """A worker's status, as CML names it. "timedout" is never a worker's: await_workers reports it for
    workers that were not where the caller wanted them by the deadline."""

    SCHEDULING = "scheduling"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    TIMEDOUT = "timedout"


SCHEDULING, RUNNING, SUCCEEDED = Status.SCHEDULING, Status.RUNNING, Status.SUCCEEDED
FAILED, STOPPED, TIMEDOUT = Status.FAILED, Status.STOPPED, Status.TIMEDOUT
TERMINAL = frozenset({SUCCEEDED, FAILED, STOPPED})

UNKNOWN_ADDRESS = "unknown"
OUTPUT_LINES_KEPT = 200  # per worker, for failure messages and output()
TAIL_LINES = 20  # lines of output quoted in a failure message
MAX_NAME = 200  # characters in launch_workers(name=...)


@dataclass(frozen=True)
class Resources:
    """What one worker asks for. memory is in GB, as in CML."""

    cpu: float
    memory: float
    nvidia_gpu: int = 0

    @property
    def memory_mib(self) -> int:
        """memory in whole MiB: a GB is 2**30 bytes, in every backend (docker's mem_limit, pods)."""
        return int(self.memory * 1024)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a backend needs to start one worker process."""

    worker_id: str
    engine_id: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    resources: Resources
    cwd: str
    replaces: str = ""  # a lost worker's id: where the backend can, this one starts where that one ran
    collect: tuple[str, ...] = ()  # paths under its working folder that come home to cwd (collect/paths.py)
    name: str = ""  # launch_workers(name=...), as CML's newer workspaces take it
    app_ports: tuple[int, ...] = ()  # CDSW_APP_PORT, CDSW_READONLY_PORT, CDSW_PUBLIC_PORT[, forwarder] (app_ports.pick)


@dataclass(frozen=True)
class Program:
    """What a worker runs once it is up: a script, code, a shell command, a function, or nothing.

    `target` ("package.module:function", called with `args`) is how frameworks run
    their own code in workers (a TF task's script with its TF_CONFIG, say).
    `files` is a tar.gz (see shipping.py) the worker unpacks first, into its working
    folder when that is its own (`files_in_cwd`), else into a private folder; a
    relative `script` is found where the files went.
    """

    script: str = ""
    code: str = ""
    target: str = ""
    args: tuple[Any, ...] = ()
    files: bytes = b""
    files_in_cwd: bool = False

    @property
    def empty(self) -> bool:
        return not self.script and not self.code and not self.target


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Ending:
    """How a worker ends, decided while its process is still on its way out (see Session._end)."""

    status: Status
    exit_code: int | None = None  # None: the process's, once it is gone
    message: str | None = None


@dataclass(eq=False)
class Worker:
    """The session's record of one worker."""

    spec: WorkerSpec
    program: Program
    kernel: str
    backend: str
    status: Status = SCHEDULING
    program_started: bool = False
    ip_address: str = UNKNOWN_ADDRESS
    hostname: str | None = None
    pid: int | None = None
    created_at: float = field(default_factory=time.time)
    running_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    message: str | None = None
    stop_requested: bool = False
    ending: Ending | None = None  # decided, reported once its process is gone
    handle: Any = None
    usage: dict[str, Any] | None = None  # its latest resource sample (events.ResourceUse.fields), while it runs
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES_KEPT))

    @property
    def id(self) -> str:
        return self.spec.worker_id

    @property
    def engine_id(self) -> int:
        return self.spec.engine_id

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def finish(self, status: Status, *, exit_code: int | None = None, message: str | None = None) -> bool:
        """Move to a terminal status once; later calls only fill in a missing exit code."""
        if self.finished:
            if self.exit_code is None and exit_code is not None:
                self.exit_code = exit_code
            return False
        self.status = status
        self.finished_at = time.time()
        self.exit_code = exit_code
        self.message = message
        return True

    def output_tail(self, lines: int = TAIL_LINES) -> str:
        return "\n".join(list(self.output)[-lines:])

    def snapshot(self) -> WorkerSnapshot:
        """This worker as it is now, frozen: what every WorkerStatus event carries."""
        return WorkerSnapshot(
            id=self.id,
            status=self.status,
            created_at=self.created_at,
            running_at=self.running_at,
            finished_at=self.finished_at,
            ip_address=self.ip_address,
            hostname=self.hostname,
            exit_code=self.exit_code,
            message=self.message,
            cpu=self.spec.resources.cpu,
            memory=self.spec.resources.memory,
            nvidia_gpu=self.spec.resources.nvidia_gpu,
            kernel=self.kernel,
            backend=self.backend,
            engine_id=self.engine_id,
            name=self.spec.name,
            # Where a browser opens what listens on its CDSW_APP_PORT; None until its address is known.
            app_url=(
                app_ports.worker_app_url(self.ip_address, self.spec.app_ports)
                if self.spec.app_ports and self.ip_address != UNKNOWN_ADDRESS
                else None
            ),
            usage=self.usage if not self.finished else None,  # what it uses now: nothing once it has ended
        )

    def to_dict(self) -> dict[str, Any]:
        """CML's worker dict (WorkerSnapshot.to_dict)."""
        return self.snapshot().to_dict()


@dataclass(frozen=True)
class WorkerSnapshot:
    """One worker at one moment, as the session's events carry it: its status (CML's strings), times
    (seconds since the epoch), address, end, and what it asked for and uses. CML's dict only at the
    edge: to_dict(), for the CML verbs and the records that `cmlcluster list` and the views' tables read."""

    id: str
    status: Status
    created_at: float = 0.0
    running_at: float | None = None
    finished_at: float | None = None
    ip_address: str = UNKNOWN_ADDRESS
    hostname: str | None = None
    exit_code: int | None = None
    message: str | None = None
    cpu: float = 0
    memory: float = 0
    nvidia_gpu: int = 0
    kernel: str = "python3"
    backend: str = ""
    engine_id: int = -1
    name: str | None = None
    app_url: str | None = None
    usage: Mapping[str, Any] | None = None  # its latest resource sample (events.ResourceUse.fields), while it runs

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    @property
    def duration(self) -> float | None:
        """Seconds from running (or created) to its end; None while it has not ended."""
        if self.finished_at is None:
            return None
        start = self.running_at if self.running_at is not None else self.created_at
        return round(self.finished_at - start, 3)

    def to_dict(self) -> dict[str, Any]:
        """CML's worker dict, plus a few fields CML does not have (docs/guide/workers.md, "Worker dicts")."""
        record: dict[str, Any] = {
            "id": self.id,
            "status": self.status.value,  # CML's string: a dict's repr shows it as CML's does
            "created_at": _iso(self.created_at),
            "running_at": _iso(self.running_at),
            "finished_at": _iso(self.finished_at),
            "duration": self.duration,
            "ip_address": self.ip_address,
            "cpu": self.cpu,
            "memory": self.memory,
            "nvidia_gpu": self.nvidia_gpu,
            "kernel": self.kernel,
            "backend": self.backend,
            "engine_id": self.engine_id,
            "hostname": self.hostname,
            "exit_code": self.exit_code,
            "name": self.name,
            "app_url": self.app_url,
        }
        if self.message:
            record["message"] = self.message
        if self.usage is not None:
            record.update(self.usage)
        return record


class StopResponse(dict[str, Any]):
    """What stop_workers returns for one worker: its dict (as list_workers'), and the HTTP-like fields
    CML's responses have (CML returns one `requests.Response` per worker, whose `status_code` its
    callers check): 200 once the worker has ended, 500 when it could not be ended."""

    def __init__(self, worker: Mapping[str, Any]):
        super().__init__(worker)
        self.status_code = 200 if worker.get("status") in TERMINAL else 500
        self.reason = "OK" if self.ok else f"worker {worker.get('id')} is still {worker.get('status')}"

    @property
    def ok(self) -> bool:
        return self.status_code < 400

    @property
    def text(self) -> str:
        return json.dumps(dict(self))

    def json(self) -> dict[str, Any]:
        return dict(self)

    def raise_for_status(self) -> None:
        if not self.ok:
            raise WorkerError(f"stop_workers: {self.status_code} {self.reason}")

    def __repr__(self) -> str:
        return f"<StopResponse [{self.status_code}] {dict.__repr__(self)}>"


def check_resources(cpu: float, memory: float, nvidia_gpu: int) -> None:
    """Refuse (ConfigError, naming the value and the fix) what no worker can be given: for launch_workers
    and for every run, before anything starts."""
    for name, value in (("cpu", cpu), ("memory", memory)):
        if not checks.number(value, above=0):
            unit = " (GB)" if name == "memory" else ""
            raise ConfigError(f"{name}={value!r}: {name}{unit} must be a number greater than 0, e.g. {name}=1")
    if not checks.whole(nvidia_gpu, 0):
        raise ConfigError(f"nvidia_gpu={nvidia_gpu!r}: must be a whole number of GPUs, 0 or more")


def validate_launch(
    n: int,
    cpu: float,
    memory: float,
    nvidia_gpu: int,
    kernel: str,
    script: str,
    code: str,
    env: Mapping[str, str] | None,
    cwd: str,
    name: str = "",
) -> Program:
    """Refuse bad input before anything starts; return what the workers will run."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not name.isprintable():
        raise ConfigError(f"name={name!r}: give the workers' name as one line of text, at most {MAX_NAME} characters")
    if not checks.whole(n, 1):
        raise ConfigError(f"n={n!r}: the number of workers must be an integer of at least 1")
    check_resources(cpu, memory, nvidia_gpu)
    if kernel not in ("python3", "python"):
        raise ConfigError(f"kernel={kernel!r}: only Python workers are supported; use kernel='python3'")
    if script and code:
        raise ConfigError(
            "both script= and code= were given: CML ignores code when a script is set, "
            "which hides mistakes; pass only one of them"
        )
    if script:
        script = user_file(script, cwd=cwd)
    check_env(env)
    return Program(script=script, code=code)


def user_file(value: object, *, name: str = "script", cwd: str | None = None) -> str:
    """The absolute path of a file the user named (a script, a key), or a ConfigError that names the
    folder searched and the fix. The one check of such a path, for every entry point.

    A relative path starts in the working folder (cwd; this process's by default), as in a shell: a
    JupyterLab kernel's is its notebook's folder, not the project's root, which is where examples
    written for a terminal at the root go wrong. `~` is the home folder, as a shell would expand it.
    """
    if not isinstance(value, (str, os.PathLike)) or not value:
        raise ConfigError(f"{name}={value!r}: give the path of a file, as a string")
    given = os.path.expanduser(os.fspath(value))
    folder = os.path.abspath(os.getcwd() if cwd is None else cwd)
    path = os.path.join(folder, given)  # an absolute path stays as it is
    if os.path.isfile(path):
        return os.path.normpath(path)
    if os.path.isdir(path):
        raise ConfigError(f"{name}={value!r}: {os.path.normpath(path)} is a folder; give the path of a file")
    if os.path.isabs(given):
        raise ConfigError(f"{name}={value!r}: no such file")
    found = _from_above(folder, given)
    fix = f"did you mean {found!r}? Give" if found else "give"
    raise ConfigError(
        f"{name}={value!r}: no such file in {folder} (the working folder, where a relative path starts; "
        f"a notebook's is its own folder); {fix} a path relative to that folder, or an absolute one"
    )


def _from_above(folder: str, value: str) -> str:
    """`value` as a path from `folder` where it names a file relative to a folder above it ("" if none):
    the script a notebook in notebooks/ names as the project's root would."""
    above = folder
    while (parent := os.path.dirname(above)) != above:
        above = parent
        if os.path.isfile(os.path.join(above, value)):
            return os.path.relpath(os.path.join(above, value), folder)
    return ""


# cmlcluster's own variables in a worker (its connection, ids, folders) start with this: env= may
# not set them. They are not secrets (Kubernetes passes them by value in the pod spec, where env=
# goes by reference to a Secret), and one set by hand would change how the worker joins.
RESERVED_ENV_PREFIX = "CMLCLUSTER_"
# Those of them a launch may set: documented knobs, never a secret.
# The modules the worker imports while it registers; its agent's log level (a worker elsewhere has no
# other way to get the session's CMLCLUSTER_LOG_LEVEL); how often its agent samples what it uses (usage.py;
# "0" turns sampling off); whether an X-ray may attach py-spy to its processes (stacks/gather.py).
SETTABLE_ENV = frozenset({wire.PRELOAD_ENV, wire.LOG_LEVEL_ENV, wire.USAGE_SECONDS_ENV, wire.PY_SPY_ENV})


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """Refuse an env= whose names are not variable names or cmlcluster's own, or whose values are
    not strings; return it. The same on every backend, before anything starts.

    A name reaches a shell on some hosts (horovodrun's `env NAME=value ...`), so only what every
    shell reads as a name passes. Messages name the key, never a value: values may be secrets.
    """
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        kind = type(env).__name__
        raise ConfigError(f"env= got a {kind}: give a dict of names to strings, e.g. {{'MY_TOKEN': '...'}}")
    for name, value in env.items():
        if not checks.env_name(name):
            raise ConfigError(
                f"env key {name!r} is not a variable name: use letters, digits and '_', not starting with a "
                "digit (e.g. 'MY_TOKEN')"
            )
        if name.startswith(RESERVED_ENV_PREFIX) and name not in SETTABLE_ENV:
            raise ConfigError(
                f"env key {name!r} is reserved: names starting with {RESERVED_ENV_PREFIX!r} are cmlcluster's own "
                "(set by it in every worker, and not kept secret); rename it, e.g. "
                f"{'MY_' + name[len(RESERVED_ENV_PREFIX) :]!r}"
            )
        if not isinstance(value, str):
            raise ConfigError(
                f"env[{name!r}] is a {type(value).__name__}: environment names and values must be strings; "
                "convert with str()"
            )
    return dict(env)
