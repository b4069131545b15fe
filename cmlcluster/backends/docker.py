"""Workers as Docker containers on one engine, each with its own IP on a user-defined network.

Every container carries labels naming its session and worker (and the session's
process and controller), so `cmlcluster cleanup` can find what a dead session left. The
containers are started with --rm and --init: when a worker's agent exits (its
program is done, it was stopped, or its controller went away) the container
is gone too. Its output is streamed into the session's folder as it is
printed, so it survives the container; a worker's exit is reported once that
stream has ended (the container's last lines are in), as the contract asks.

The controller listens on the network's gateway, the host's own address on
that network, which every container reaches. What concerns the engine itself (its
client, the image, the network, orphans' cleanup) is in docker_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import BackendError, ConfigError
from ..resources import GpuPool, visible_gpus
from ..workers import PACKAGE_PARENT, Resources, WorkerSpec
from .base import (
    OUTPUT_DRAIN_SECONDS,
    Backend,
    Capabilities,
    SessionContext,
    log_tail,
    run_tag_labels,
    signal_exit_code,
)
from .docker_engine import (
    DEFAULT_IMAGE,
    DEFAULT_NETWORK,
    LABEL,
    check_gpu_runtime,
    check_image,
    connect,
    ensure_network,
    gpu_request,
    origin_labels,
    remove_orphans,
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


class DockerBackend(Backend[DockerHandle]):
    """Options (image and host_python also from CMLCLUSTER_DOCKER_IMAGE, CMLCLUSTER_DOCKER_HOST_PYTHON=1):

    image: the worker image (cmlcluster, Python and, for Horovod, sshd and Horovod in it).
    network: a user-defined bridge network, created when missing and then kept, as Docker keeps its own
        bridge: every session on this engine shares it, and removing it when one session ends would
        pull it from under another starting at that moment (and move its gateway, where its
        controller listens).
    volumes: {host path: container path} (or "host:container[:ro]" strings), shared by every worker:
        data, checkpoints, logs, like the EFS mount of the AWS template.
    host_python: bind-mount this host's /usr, Python environment and cmlcluster read-only, so
        a bare image runs the session's own interpreter (the test setup; see scripts/docker_engine.sh).
    mount_cwd: mount the session's working folder at the same path, read-write, so workers see
        the project's files as CML workers do (default True).
    gpu_ids: the GPU ids to hand out (default: nvidia-smi's); without any, requests are by count.
    python: the interpreter in the image (ignored with host_python).
    """

    name = "docker"

    def __init__(
        self,
        image: str | None = None,
        network: str = DEFAULT_NETWORK,
        volumes: Mapping[str, str] | Iterable[str] | None = None,
        host_python: bool | None = None,
        mount_cwd: bool = True,
        gpu_ids: Sequence[str] | None = None,
        python: str = "python3",
    ):
        # The environment can choose these once for every session (CMLCLUSTER_BACKEND=docker and these).
        self.image = image or os.environ.get("CMLCLUSTER_DOCKER_IMAGE", DEFAULT_IMAGE)
        self.network = network
        self.volumes = _parse_volumes(volumes)
        if host_python is None:
            host_python = os.environ.get("CMLCLUSTER_DOCKER_HOST_PYTHON", "") not in ("", "0")
        self.host_python = host_python
        self.mount_cwd = mount_cwd
        self.python = python
        self._gpus = GpuPool(list(gpu_ids) if gpu_ids is not None else visible_gpus())
        self._client: Any = None
        self._gateway: str | None = None
        # Containers start and stop in parallel; the SDK blocks, so each call gets a thread.
        # Made per session (attach), so that the backend serves the next session after close().
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- before anything starts

    async def check(self, n: int, resources: Resources) -> None:
        await asyncio.to_thread(self._check, n, resources)

    def _check(self, n: int, resources: Resources) -> None:
        client = self._client or connect()
        self._client = client
        check_image(client, self.image)
        if resources.nvidia_gpu:
            check_gpu_runtime(client, resources.nvidia_gpu)
            if self._gpus.all:
                self._gpus.check(n, resources)

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        self._client = self._client or await asyncio.to_thread(connect)
        self._gateway = await asyncio.to_thread(ensure_network, self._client, self.network)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="cmlcluster-docker")

    def controller_ip(self) -> str:
        assert self._gateway is not None, "attach() first"
        return self._gateway

    def capabilities(self) -> Capabilities:
        return Capabilities(
            own_address=True,
            session_host=False,
            python=sys.executable if self.host_python else self.python,
            shared_paths=tuple(self._same_path_mounts(os.getcwd())),
            interfaces=("eth0",),  # a container's interface on its network
        )

    def _same_path_mounts(self, cwd: str) -> dict[str, str]:
        """{host path: "path:mode"} of what containers see at the session's own paths."""
        mounts = {host: binding for host, binding in self.volumes.items() if binding.rpartition(":")[0] == host}
        if self.mount_cwd:
            mounts[cwd] = f"{cwd}:rw"
        if self.host_python:
            for path in (sys.base_prefix, sys.prefix, PACKAGE_PARENT):
                if not path.startswith("/usr/"):
                    mounts.setdefault(path, f"{path}:ro")
        return mounts

    # ---------------------------------------------------------------- workers

    def container_options(self, spec: WorkerSpec, gpus: Sequence[str]) -> dict[str, Any]:
        """Everything sent to Docker for one worker (tests inspect this)."""
        mounts = dict(self.volumes)
        mounts.update(self._same_path_mounts(spec.cwd))
        if self.host_python:
            mounts["/usr"] = "/usr:ro"
        options: dict[str, Any] = {
            "image": self.image,
            "command": list(spec.argv),
            "name": f"cmlcluster-{spec.worker_id}",
            "hostname": f"worker-{spec.worker_id}",
            "environment": dict(spec.env),
            "working_dir": spec.cwd,
            "network": self.network,
            "labels": {
                f"{LABEL}.session": self.context.session_id,
                f"{LABEL}.worker": spec.worker_id,
                **origin_labels(spec.env),
                **run_tag_labels(),
            },
            "nano_cpus": int(spec.resources.cpu * 1e9),
            "mem_limit": f"{spec.resources.memory_mib}m",
            "volumes": [f"{host}:{binding}" for host, binding in mounts.items()],
            "init": True,  # signals reach the agent, and it is not PID 1
            "auto_remove": True,
            "detach": True,
        }
        if spec.resources.nvidia_gpu:
            options["device_requests"] = [gpu_request(gpus, spec.resources.nvidia_gpu)]
        return options

    async def start(self, spec: WorkerSpec) -> DockerHandle:
        gpus = self._gpus.take(spec.resources.nvidia_gpu) if self._gpus.all else []
        log_dir = os.path.join(self.context.session_dir, "workers")
        os.makedirs(log_dir, exist_ok=True)
        options = self.container_options(spec, gpus)
        # Create, start watching for the exit, then start: a container that dies at once is still seen.
        try:
            container = await self._call(self._client.containers.create, **_create_options(options))
        except Exception as e:
            self._gpus.give_back(gpus)
            raise BackendError(f"could not create container for worker {spec.worker_id}: {_explain(e)}") from e
        loop = asyncio.get_running_loop()
        handle = DockerHandle(
            container=container,
            worker_id=spec.worker_id,
            log_path=os.path.join(log_dir, f"{spec.worker_id}.log"),
            gpus=gpus,
            exited=loop.create_future(),
            copied=loop.create_future(),
        )
        _thread(f"wait-{spec.worker_id}", self._wait_for_exit, handle, loop)
        try:
            await self._call(container.start)
        except Exception as e:
            handle.copied.set_result(None)  # nothing ran: no output to wait for
            await self.stop(handle, 0)
            raise BackendError(f"could not start container for worker {spec.worker_id}: {_explain(e)}") from e
        _thread(f"logs-{spec.worker_id}", self._copy_output, handle, loop)
        return handle

    def _wait_for_exit(self, handle: DockerHandle, loop: asyncio.AbstractEventLoop) -> None:
        # Runs on its own thread for the container's life; "removed" is what --rm ends with.
        try:
            code = int(handle.container.wait(condition="removed", timeout=None)["StatusCode"])
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
            with contextlib.suppress(Exception), open(handle.log_path, "ab") as log:
                for chunk in handle.container.logs(stream=True, follow=True, stdout=True, stderr=True):
                    log.write(chunk)
                    log.flush()
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
                    await self._call(handle.container.remove, force=True)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(handle.exited), 10)
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
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._client, self._pool = None, None

    @classmethod
    def cleanup(cls, dry_run: bool, options: Mapping[str, Any]) -> list[str]:
        return [f"container {name}" for name in remove_orphans(dry_run=dry_run)]

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        assert self._pool is not None, "attach() first"
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: function(*args, **kwargs))


def _create_options(options: dict[str, Any]) -> dict[str, Any]:
    created = dict(options)
    created.pop("detach")
    return created


def _thread(name: str, target: Callable[..., None], *args: Any) -> None:
    threading.Thread(target=target, args=args, name=f"cmlcluster-docker-{name}", daemon=True).start()


def _explain(error: Exception) -> str:
    return str(getattr(error, "explanation", None) or error)


def _parse_volumes(volumes: Mapping[str, str] | Iterable[str] | None) -> dict[str, str]:
    """{host: "container[:mode]"} from a mapping or "host:container[:mode]" strings; host paths must exist."""
    parsed: dict[str, str] = {}
    if volumes is None:
        return parsed
    items = volumes.items() if isinstance(volumes, Mapping) else (_split_volume(v) for v in volumes)
    for host, target in items:
        if not os.path.isabs(host) or not os.path.exists(host):
            raise ConfigError(f"volumes: {host!r} is not an existing absolute path on this host; create it first")
        parsed[host] = target if target.count(":") else f"{target}:rw"
    return parsed


def _split_volume(volume: str) -> tuple[str, str]:
    host, sep, target = volume.partition(":")
    if not sep or not target:
        raise ConfigError(f"volumes: {volume!r} should be 'host path:container path[:ro]'")
    return host, target
