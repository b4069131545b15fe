"""Workers as Docker containers on one engine, each with its own IP on the session's own network.

Every container and the session's network carry labels naming their session (and the session's
process; containers also their worker and controller), so `cmlcluster cleanup` can find what a dead
session left. The containers are started with --rm and --init: when a worker's agent exits (its
program is done, it was stopped, or its controller went away) the container is gone too (one
whose collect= files come home, once they are copied out: docker/collect.py). Its output is streamed
into the session's folder as it is printed, so it survives the container; a worker's exit is
reported once that stream has ended (the container's last lines are in), as the contract asks.

The controller listens on the network's gateway, the host's own address on
that network, which every container reaches. What concerns the engine itself (its
client, the image, the networks, orphans' cleanup) is in docker/engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..._aio import settle_on_this_thread
from ..._proc import python_module
from ...errors import BackendError
from ...logfile import CappedLog
from ...resources import GpuPool, check_fits_machine, visible_gpus
from ...workers import Resources, WorkerSpec
from ..base import OUTPUT_DRAIN_SECONDS, Backend, Capabilities, SessionContext, log_tail, signal_exit_code
from . import collect
from . import ranges as docker_ranges
from . import worker as docker_worker
from .engine import (
    DEFAULT_IMAGE,
    LABEL,
    SessionStates,
    check_gpu_runtime,
    check_image,
    connect,
    controller_label,
    ensure_network,
    gpu_request,
    remove_orphan_networks,
    remove_orphans,
    remove_session_network,
    session_labels,
    session_network,
    session_network_name,
)

T = TypeVar("T")


@dataclass(eq=False)
class DockerHandle:
    container: Any
    worker_id: str
    log_path: str
    gpus: list[str]
    exited: asyncio.Future[int]  # the container is gone (removed), with this exit code
    copied: asyncio.Future[None]  # its log stream has ended: all of its output is in log_path
    released: bool = field(default=False)
    spec: WorkerSpec | None = None  # what it was started for: its collect= files come home (docker/collect.py)


class DockerBackend(Backend[DockerHandle]):
    """Options (image and host_python also from CMLCLUSTER_DOCKER_IMAGE, CMLCLUSTER_DOCKER_HOST_PYTHON=1):

    image: the worker image (cmlcluster, Python and, for Horovod, sshd and Horovod in it).
    network: None (the default) gives each session a bridge network of its own, cmlcluster-<session id>,
        removed when the session closes (or by `cmlcluster cleanup` once its session is gone): no other
        session's container reaches its workers, whose servers (TensorFlow's) listen on every
        interface. The opt-out: the name of a user-defined bridge network that sessions share (your
        own, or any name: created when missing), never removed, as Docker keeps its own bridge;
        every container on it reaches the workers. Each session network takes one of the engine's
        address ranges (about 30 on a default engine); sharing one spares them.
    user: "uid:gid" the workers run as (default: this process's, so that files they write in
        mounted folders are the notebook user's). Containers run with every capability dropped,
        no-new-privileges and a pids limit; as root (uid 0) they keep only what sshd needs
        (docker_worker.ROOT_SSHD_CAPABILITIES). A user that is not root gets HOME in a folder of its own.
    pids_limit: the most processes and threads in one worker (default 4096; None: no limit), so a
        fork bomb or a thread leak cannot take the engine's host down.
    volumes: {host path: container path} (or "host:container[:ro]" strings), shared by every worker:
        data, checkpoints, logs, like the EFS mount of the AWS template.
    host_python: bind-mount this host's /usr, Python environment and cmlcluster read-only, so
        a bare image runs the session's own interpreter (the test setup; see scripts/docker_engine.sh).
    mount_cwd: mount the session's working folder at the same path, read-write, so workers see
        the project's files as CML workers do (default True).
    gpu_ids: the GPU ids to hand out (default: nvidia-smi's); without any, requests are by count.
    python: the interpreter in the image (ignored with host_python).

    The controller's connection info (the session's keys) is a 0600 file of the worker's user in
    the container, put there between create and start, never in the container's environment,
    which `docker inspect` shows to whoever asks (and monitoring agents collect).
    """

    name = "docker"

    def __init__(
        self,
        image: str | None = None,
        network: str | None = None,
        user: str | None = None,
        pids_limit: int | None = docker_worker.DEFAULT_PIDS_LIMIT,
        volumes: Mapping[str, str] | Iterable[str] | None = None,
        host_python: bool | None = None,
        mount_cwd: bool = True,
        gpu_ids: Sequence[str] | None = None,
        python: str = "python3",
    ):
        # The environment can choose these once for every session (CMLCLUSTER_BACKEND=docker and these).
        self.image = image or os.environ.get("CMLCLUSTER_DOCKER_IMAGE", DEFAULT_IMAGE)
        self.network = network
        self.user = user if user is not None else f"{os.getuid()}:{os.getgid()}"
        self.uid, self.gid = docker_worker.parse_user(self.user)
        self.pids_limit = docker_worker.check_pids_limit(pids_limit)
        self.volumes = docker_worker.parse_volumes(volumes)
        if host_python is None:
            host_python = os.environ.get("CMLCLUSTER_DOCKER_HOST_PYTHON", "") not in ("", "0")
        self.host_python = host_python
        self.mount_cwd = mount_cwd
        self.python = python
        self._gpus = GpuPool(list(gpu_ids) if gpu_ids is not None else visible_gpus())
        self._client: Any = None
        self._gateway: str | None = None
        self._reaper: subprocess.Popen[bytes] | None = None  # docker_reaper, for a session network
        # Containers start and stop in parallel; the SDK blocks, so each call gets a thread.
        # Made per session (attach), so that the backend serves the next session after close().
        self._pool: ThreadPoolExecutor | None = None
        self._addresses: dict[str, str] = {}  # worker id: its IP, for a replacement (stable_addresses)
        self._engine_here = True  # whether containers run on this machine: until attach asks the engine

    # ---------------------------------------------------------------- before anything starts

    async def check(self, n: int, resources: Resources) -> None:
        await self._call(self._check, n, resources)

    def _check(self, n: int, resources: Resources) -> None:
        client = self._client or connect()
        self._client = client
        check_image(client, self.image)
        info = client.info()  # the engine's machine: a container gets no more than it has
        cpus, memory = int(info.get("NCPU") or 0), info.get("MemTotal")
        if cpus:  # memory= counts GB of 2**30 bytes
            where = f"Docker's engine ({info.get('Name') or 'its host'})"
            check_fits_machine(resources, cpus, memory / 2**30 if memory else None, machine=where, workers="docker")
        if resources.nvidia_gpu:
            check_gpu_runtime(client, resources.nvidia_gpu)
            if self._gpus.all:
                self._gpus.check(n, resources)

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        self._client = self._client or await self._call(connect)
        self._addresses.clear()
        self._engine_here = await self._call(lambda: docker_ranges.engine_is_here(self._client.info()))
        if self.network is None:
            # First the reaper, which removes what the session made should its process die unclosed.
            self._reaper = subprocess.Popen(
                python_module("cmlcluster.backends.docker.reaper", context.session_id),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the notebook's process group is not its end
            )
            self._gateway = await self._call(session_network, self._client, context.session_id)
        else:
            self._gateway = await self._call(ensure_network, self._client, self.network)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="cmlcluster-docker")

    def controller_ip(self) -> str:
        if self._gateway is None:
            raise BackendError(
                f"the docker backend's address on network {self.network!r} is known once it has launched workers"
            )
        return self._gateway

    def capabilities(self) -> Capabilities:
        return Capabilities(
            own_address=True,
            session_host=False,
            python=sys.executable if self.host_python else self.python,
            shared_paths=tuple(self._same_path_mounts(os.getcwd())),
            stable_addresses=self.network is None,  # its session network's range is pinned (docker_engine)
            interfaces=("eth0",),  # a container's interface on its network
            collects=True,  # copied out of a stopped container (docker/collect.py)
            session_machine=self._engine_here,
        )

    # ---------------------------------------------------------------- workers

    def _same_path_mounts(self, cwd: str) -> dict[str, str]:
        return docker_worker.same_path_mounts(self.volumes, cwd, self.mount_cwd, self.host_python)

    def container_options(self, spec: WorkerSpec, gpus: Sequence[str]) -> dict[str, Any]:
        """Everything sent to Docker for one worker (tests inspect this), but its files (docker_worker.files)."""
        mounts = dict(self.volumes)
        mounts.update(self._same_path_mounts(spec.cwd))
        if self.host_python:
            mounts["/usr"] = "/usr:ro"
        options: dict[str, Any] = {
            "image": self.image,
            "command": list(spec.argv),
            "name": f"cmlcluster-{spec.worker_id}",
            "hostname": f"worker-{spec.worker_id}",
            "environment": docker_worker.environment(spec, self.uid),
            "working_dir": spec.cwd if self.capabilities().sees(spec.cwd) else docker_worker.work_folder(spec),
            "network": self.network or session_network_name(self.context.session_id),
            "labels": {
                **session_labels(self.context.session_id),
                f"{LABEL}.worker": spec.worker_id,
                **controller_label(spec.env),
            },
            "user": self.user,
            **docker_worker.privileges(self.uid, self.pids_limit),
            "nano_cpus": int(spec.resources.cpu * 1e9),
            "mem_limit": f"{spec.resources.memory_mib}m",
            "volumes": [f"{host}:{binding}" for host, binding in mounts.items()],
            "init": True,  # signals reach the agent, and it is not PID 1
            "auto_remove": not collect.keeps_container(spec, self.capabilities()),  # kept: its files come home first
            "detach": True,
        }
        if spec.resources.nvidia_gpu:
            options["device_requests"] = [gpu_request(gpus, spec.resources.nvidia_gpu)]
        if spec.replaces in self._addresses:  # where the lost worker ran: a TensorFlow task is its address
            address = {"IPAMConfig": {"IPv4Address": self._addresses[spec.replaces]}}
            options["networking_config"] = {options["network"]: address}
        return options

    async def start(self, spec: WorkerSpec) -> DockerHandle:
        gpus = self._gpus.take(spec.resources.nvidia_gpu) if self._gpus.all else []
        options = self.container_options(spec, gpus)
        # Create, give it its files, start watching for the exit, then start: a container that dies at
        # once is still seen.
        try:
            container = await self._call(self._client.containers.create, **_create_options(options))
        except Exception as e:
            self._gpus.give_back(gpus)
            raise BackendError(f"could not create container for worker {spec.worker_id}: {_explain(e)}") from e
        try:
            # Into the container's own layer, Docker keeping the archive's owners and modes: unlike a
            # bind-mounted file of the session's folder, this needs no chown to another uid (which only
            # root may do), works with an engine on another machine, and goes with the container.
            if not await self._call(container.put_archive, "/", docker_worker.files(spec, self.uid, self.gid)):
                raise BackendError("Docker did not take the archive")
        except Exception as e:
            with contextlib.suppress(Exception):
                await self._call(container.remove, force=True)
            self._gpus.give_back(gpus)
            raise BackendError(f"could not give worker {spec.worker_id} its connection info: {_explain(e)}") from e
        loop = asyncio.get_running_loop()
        handle = DockerHandle(
            container=container,
            worker_id=spec.worker_id,
            log_path=self.context.log_path(spec.worker_id),
            gpus=gpus,
            exited=loop.create_future(),
            copied=loop.create_future(),
            spec=spec,
        )
        _thread(f"wait-{spec.worker_id}", self._wait_for_exit, handle, loop)
        try:
            await self._call(container.start)
        except Exception as e:
            handle.copied.set_result(None)  # nothing ran: no output to wait for
            await self.stop(handle, 0)
            raise BackendError(f"could not start container for worker {spec.worker_id}: {_explain(e)}") from e
        _thread(f"logs-{spec.worker_id}", self._copy_output, handle, loop)
        if self.network is None:  # stable addresses: where a replacement of this worker is to start
            with contextlib.suppress(Exception):  # gone already: its replacement gets any address
                await self._call(container.reload)
                self._addresses[spec.worker_id] = container.attrs["NetworkSettings"]["Networks"][options["network"]][
                    "IPAddress"
                ]
        return handle

    def _wait_for_exit(self, handle: DockerHandle, loop: asyncio.AbstractEventLoop) -> None:
        # Runs on its own thread for the container's life; "removed" is what --rm ends with.
        try:
            code = int(collect.wait_then_bring_home(handle.container, handle.spec, self.context)["StatusCode"])
        except Exception:
            code = 255  # the container vanished before the wait began; its code is lost
        code = signal_exit_code(code)  # docker-init exits with 128+N when the agent dies of signal N

        def report() -> None:
            if not handle.exited.done():
                handle.exited.set_result(code)

        with contextlib.suppress(RuntimeError):  # the session's loop is gone
            loop.call_soon_threadsafe(report)

    def _copy_output(self, handle: DockerHandle, loop: asyncio.AbstractEventLoop) -> None:
        # Runs on its own thread. The followed log ends once the container has stopped and all of
        # its output has been sent, which can be after the container is gone (seen: 6,000 lines
        # behind when the exit watcher's "removed" came); so an exit is reported after this ends.
        try:
            with contextlib.suppress(Exception), CappedLog(handle.log_path) as log:
                for chunk in handle.container.logs(stream=True, follow=True, stdout=True, stderr=True):
                    log.write(chunk)
        finally:

            def report() -> None:
                if not handle.copied.done():
                    handle.copied.set_result(None)

            with contextlib.suppress(RuntimeError):  # the session's loop is gone
                loop.call_soon_threadsafe(report)

    async def _ended(self, handle: DockerHandle) -> int:
        """The exit code once the container is gone and its log has been copied to its end (at most
        OUTPUT_DRAIN_SECONDS later: a stream that never ends must not hide the exit)."""
        code = await asyncio.shield(handle.exited)
        await asyncio.wait([handle.copied], timeout=OUTPUT_DRAIN_SECONDS)
        return code

    async def poll(self, handle: DockerHandle) -> int | None:
        return handle.exited.result() if handle.exited.done() else None

    async def wait(self, handle: DockerHandle) -> int:
        code = await self._ended(handle)
        self._release(handle)
        return code

    async def stop(self, handle: DockerHandle, grace: float = 5.0) -> None:
        # TERM, then KILL after grace; --rm removes the container once it has exited, and
        # the exit watcher resolves when it is removed. A gone container is already stopped.
        if not handle.exited.done():
            with contextlib.suppress(Exception):
                await self._call(handle.container.kill, signal="SIGTERM")
            try:
                await asyncio.wait_for(asyncio.shield(handle.exited), grace)
            except asyncio.TimeoutError:
                with contextlib.suppress(Exception):
                    await self._call(collect.end_container, handle.container)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(handle.exited), collect.removal_wait(handle.container))
        if handle.exited.done():
            await self._ended(handle)
        self._release(handle)

    def _release(self, handle: DockerHandle) -> None:
        if not handle.released:
            handle.released = True
            self._gpus.give_back(handle.gpus)

    def output(self, handle: DockerHandle) -> str:
        return log_tail(handle.log_path)

    async def close(self) -> None:
        # Every worker was stopped (their containers removed) before: the session's network is free.
        removed = False
        try:
            if self.network is None and self._client is not None:
                await self._call(remove_session_network, self._client, self.context.session_id)
                removed = True  # and so were its containers: a network with one attached stays
        finally:
            if self._client is not None:
                await self._call(self._client.close)
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._client, self._pool = None, None
            reaper, self._reaper = self._reaper, None
            if reaper is not None:
                assert reaper.stdin is not None
                if removed:
                    reaper.kill()  # nothing left for it: not a second look through the engine (0.15 s)
                reaper.stdin.close()  # else its cue: it removes what is left, and exits
                await asyncio.to_thread(reaper.wait)

    @classmethod
    def cleanup(cls, dry_run: bool, options: Mapping[str, Any]) -> list[str]:
        # Containers first: a network is free once its containers are gone.
        client, states = connect(), SessionStates()
        try:
            containers = remove_orphans(client, dry_run=dry_run, states=states)
            networks = remove_orphan_networks(client, dry_run=dry_run, states=states)
        finally:
            client.close()
        return [f"container {name}" for name in containers] + [f"network {name}" for name in networks]

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """function(*args, **kwargs), which blocks, on the session's pool (or, before attach, any thread).

        A session closed by atexit (the interpreter exiting) finds every executor refusing work:
        Python shuts them down before atexit runs. Its calls get a thread of their own, so that its
        workers are stopped and its network removed (measured: without, the exit of a session with
        one worker took 35 s instead of 3, and left its network)."""
        loop = asyncio.get_running_loop()
        call = functools.partial(function, *args, **kwargs)
        try:
            future = loop.run_in_executor(self._pool, call)  # submits now: a refusal raises here
        except RuntimeError:
            future = loop.create_future()
            _thread("exiting", settle_on_this_thread, future, loop, call)
        return await future


def _create_options(options: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in options.items() if name != "detach"}


def _thread(name: str, target: Callable[..., None], *args: Any) -> None:
    threading.Thread(target=target, args=args, name=f"cmlcluster-docker-{name}", daemon=True).start()


def _explain(error: Exception) -> str:
    return str(getattr(error, "explanation", None) or error)
