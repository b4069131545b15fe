"""Workers as pods, placed by Kubernetes, through the official client.

One Secret per session carries the controller's connection info and owns every worker pod, and
one NetworkPolicy admits to them only the session's pods and the notebook (session_objects); the
backend deletes its pods itself, and Kubernetes' garbage collector removes whatever a dead session
left once the Secret goes (or once the notebook's own pod goes, which owns the Secret when the
notebook runs in a cluster).

What is checked before anything starts is in ``preflight``; what happens to pods is learnt from
one watch of the session's pods (``watch``), read with the pure readers of ``pods``.

The client blocks; every call runs on a thread (asyncio.to_thread), the watch and each pod's log
on threads of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ... import checks
from ...errors import BackendError, ConfigError
from ...ports import route_address
from ...wire import CONNECTION_ENV
from ...workers import Resources, WorkerSpec
from ..base import Backend, Capabilities, SessionContext, log_tail
from . import manifests, names, orphans, preflight
from .options import DEFAULT_FS_GROUP, PodOptions, SharedVolume
from .pods import NO_EXIT_CODE, api_message
from .session_objects import SessionObjects
from .watch import WATCH_SECONDS, PodHandle, PodTracker, PodWatch

log = logging.getLogger(__name__)

STOP_CONFIRM_SECONDS = 30.0  # after a pod's grace period, how long its deletion may take to show in the watch


class KubernetesBackend(Backend[PodHandle]):
    """Options (image, namespace and controller_ip also from CMLCLUSTER_KUBERNETES_IMAGE, _NAMESPACE, _CONTROLLER_IP):

    image: the worker image (the repository's Dockerfile: Python, cmlcluster, sshd for Horovod).
    namespace: where the pods go; default: the notebook pod's own namespace in a cluster, else the
        kubeconfig context's, else "default".
    controller_ip: the address pods reach this session's controller at. In a cluster: this pod's
        IP, found by itself. Outside one it must be given: an address of this machine that the
        cluster's pods can route to.
    configuration: a kubernetes.client.Configuration; default: in-cluster config inside a pod,
        else the kubeconfig (KUBECONFIG or ~/.kube/config) and its current context.
    node_selector, tolerations, service_account, image_pull_secrets, env, shared_volume: for every
        worker pod (see options.PodOptions).
    fs_group (default 1000; None on OpenShift, whose SCC assigns one), run_as_user (default None:
        the image's or the cluster's), work_size (the working folder's size limit, "10Gi"),
        ephemeral_storage (local disk requested; default work_size): pods pass Pod Security
        "restricted" (see options.PodOptions).
    network_policy: a NetworkPolicy per session admitting to its pods only the session's own pods
        and the notebook (controller_ip and its pod's address; in a cluster also its pod by a label
        that pod alone has, cmlcluster.io/pod-uid, which the session adds where it may patch pods);
        default True. Turn it off where no network plugin enforces policies or the namespace's
        own policies decide.
    allow_from: NetworkPolicyPeer dicts also admitted, e.g. [{"ipBlock": {"cidr": "192.0.2.0/24"}}]
        where the notebook reaches the pods through a NAT or VPN that changes its address.
    wait_for_nodes: seconds a pod the scheduler cannot place may wait (for a cluster autoscaler to
        add a node) before it fails with the scheduler's message; default 0: at once.
    notebook_pod: the pod the notebook runs in, in `namespace`: it owns the session's Secret, so
        that its workers go when it goes. Default in a cluster: this pod (HOSTNAME); outside: none.
    python: the interpreter in the image.
    """

    name = "kubernetes"

    def __init__(
        self,
        image: str | None = None,
        namespace: str | None = None,
        controller_ip: str | None = None,
        *,
        configuration: Any = None,
        node_selector: dict[str, str] | None = None,
        tolerations: list[dict[str, Any]] | None = None,
        service_account: str | None = None,
        image_pull_secrets: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        shared_volume: SharedVolume | None = None,
        fs_group: int | None = DEFAULT_FS_GROUP,
        run_as_user: int | None = None,
        work_size: str = "10Gi",
        ephemeral_storage: str | None = None,
        network_policy: bool = True,
        allow_from: list[dict[str, Any]] | tuple[dict[str, Any], ...] = (),
        wait_for_nodes: float = 0.0,
        notebook_pod: str | None = None,
        python: str = "python3",
    ):
        self.image = image or os.environ.get("CMLCLUSTER_KUBERNETES_IMAGE", "")
        self._namespace = namespace or os.environ.get("CMLCLUSTER_KUBERNETES_NAMESPACE") or None
        self._controller_ip = controller_ip or os.environ.get("CMLCLUSTER_KUBERNETES_CONTROLLER_IP") or None
        self.options = PodOptions(
            node_selector=node_selector or {},
            tolerations=tolerations or (),
            service_account=service_account,
            image_pull_secrets=tuple(image_pull_secrets),
            env=env or {},
            shared_volume=shared_volume,
            fs_group=fs_group,
            run_as_user=run_as_user,
            work_size=work_size,
            ephemeral_storage=ephemeral_storage,
            network_policy=network_policy,
            allow_from=allow_from,
        )
        if not checks.number(wait_for_nodes, low=0):
            raise ConfigError(f"wait_for_nodes={wait_for_nodes!r}: give seconds, 0 or more")
        self.wait_for_nodes = float(wait_for_nodes)
        self.notebook_pod = notebook_pod
        self.python = python
        self._configuration = configuration
        self._in_cluster = False
        self._api: Any = None  # kubernetes.client.ApiClient
        self._checked = False
        self._handles: dict[str, PodHandle] = {}  # by pod name
        self._objects: SessionObjects | None = None  # the session's Secret and NetworkPolicy, from attach on
        self._watching: PodWatch | None = None
        self._pods: PodTracker | None = None  # what the watch says, from attach on
        # Threads that create or delete pods, which close() waits for: none may be left behind.
        self._background: list[threading.Thread] = []

    # ---------------------------------------------------------------- configuration

    @property
    def namespace(self) -> str:
        self._connect()
        assert self._namespace is not None
        return self._namespace

    def _connect(self) -> Any:
        """The API client, made once from the configuration (ConfigError when there is none)."""
        if self._api is None:
            configuration, self._in_cluster = preflight.load_configuration(self._configuration)
            if self._namespace is None:
                self._namespace = preflight.default_namespace(self._in_cluster)
            from kubernetes import client

            self._api = client.ApiClient(configuration)
        return self._api

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._connect())

    def _networking(self) -> Any:
        from kubernetes import client

        return client.NetworkingV1Api(self._connect())

    def controller_ip(self) -> str:
        if self._controller_ip:
            return self._controller_ip
        in_pod = os.environ.get("KUBERNETES_SERVICE_HOST")
        if in_pod:
            self._controller_ip = os.environ.get("POD_IP") or route_address(in_pod)
            return self._controller_ip
        raise ConfigError(
            "controller_ip=None: outside a Kubernetes cluster, say which address of this machine the cluster's pods "
            "reach it at: use_backend('kubernetes', controller_ip='10.0.0.5'), or CMLCLUSTER_KUBERNETES_CONTROLLER_IP"
        )

    def capabilities(self) -> Capabilities:
        shared = self.options.shared_volume
        # The session sees the shared volume at the workers' path only if it is mounted here too
        # (a notebook pod with the same claim at the same path).
        seen = shared is not None and os.path.isdir(shared.mount_path)
        return Capabilities(
            own_address=True,
            session_host=False,
            python=self.python,
            shared_paths=(shared.mount_path,) if seen and shared is not None else (),
            interfaces=("eth0",),
        )

    # ---------------------------------------------------------------- before anything starts

    @classmethod
    def cleanup(cls, dry_run: bool, options: Mapping[str, Any]) -> list[str]:
        """What dead sessions of this host left on the cluster of the current configuration (the
        kubeconfig, or this pod's cluster), in options["namespace"] or the configuration's."""
        return delete_orphans(cls(namespace=options.get("namespace")), dry_run=dry_run)

    async def check(self, n: int, resources: Resources) -> None:
        await asyncio.to_thread(self._check, n, resources)

    def _check(self, n: int, resources: Resources) -> None:
        preflight.check_image(self.image)
        self.controller_ip()
        if not self._checked:
            preflight.check_access(
                self._connect(),
                self.namespace,
                notebook_pod=self.notebook_pod,
                image_pull_secrets=self.options.image_pull_secrets,
                network_policy=self.options.network_policy,
            )
            self._checked = True
        if resources.nvidia_gpu:
            preflight.check_gpus(self._core(), resources.nvidia_gpu)

    # ---------------------------------------------------------------- session

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        await asyncio.to_thread(self._connect)
        notebook_pod = self.notebook_pod or (os.environ.get("HOSTNAME", "") if self._in_cluster else "")
        self._objects = SessionObjects(
            self._core,
            self._networking,
            self.namespace,
            context.session_id,
            self.options,
            notebook_pod,
            self.controller_ip,
        )
        self._handles = {}
        tracker = self._pods = PodTracker(
            self._handles, self._core(), self.namespace, self.wait_for_nodes, self._delete_in_background
        )
        selector = names.session_selector(self.context.session_id)
        self._watching = PodWatch(self._core(), self.namespace, selector, tracker.report, tracker.report_missing)
        self._watching.start()

    async def start(self, spec: WorkerSpec) -> PodHandle:
        from kubernetes.client.rest import ApiException

        assert self._objects is not None, "attach() first"
        try:
            secret = await asyncio.to_thread(self._objects.secret, spec.env[CONNECTION_ENV], spec)
        except ApiException as e:
            raise BackendError(f"could not create or update the session's Secret: {api_message(e)}") from e
        body = manifests.worker_pod(
            spec,
            session_id=self.context.session_id,
            namespace=self.namespace,
            image=self.image,
            secret_name=secret["name"],
            secret_uid=secret["uid"],
            options=self.options,
        )
        name = body["metadata"]["name"]
        handle = PodHandle(
            worker_id=spec.worker_id,
            name=name,
            log_path=self.context.log_path(spec.worker_id),
            loop=asyncio.get_running_loop(),
            exited=asyncio.get_running_loop().create_future(),
        )
        self._handles[name] = handle  # before the create: its first events may come before the reply
        created: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def create() -> None:  # on a thread of its own, so that a cancelled start still learns the outcome
            try:
                pod = self._core().create_namespaced_pod(self.namespace, body)
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
                    created.set_result(pod)
            except BaseException as e:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    created.set_exception(e)
            if handle.abandoned:
                self._delete_pod_quietly(name)

        self._in_background(create, f"cmlcluster-create-{spec.worker_id}")
        try:
            await asyncio.wrap_future(created)
        except ApiException as e:  # refused: no pod
            del self._handles[name]
            raise BackendError(f"could not create pod {name} for worker {spec.worker_id}: {api_message(e)}") from e
        except BaseException as e:
            # Cancelled, or the connection broke: the pod may exist all the same, and must not stay.
            self._handles.pop(name, None)
            handle.abandoned = True
            if created.done():  # else create() deletes it once the API has answered
                self._delete_in_background(handle)
            if isinstance(e, Exception):
                raise BackendError(f"could not create pod {name} for worker {spec.worker_id}: {e}") from e
            raise
        handle.created_at = time.monotonic()
        return handle

    def _in_background(self, target: Callable[[], None], name: str) -> None:
        self._background = [t for t in self._background if t.is_alive()]
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._background.append(thread)

    def _delete_in_background(self, handle: PodHandle) -> None:
        """Its pod deleted on a thread of its own, not the loop's executor: close() may run on another loop."""
        self._in_background(lambda: self._delete_pod_quietly(handle.name), f"cmlcluster-delete-{handle.worker_id}")

    # ---------------------------------------------------------------- the contract

    async def poll(self, handle: PodHandle) -> int | None:
        return handle.exited.result() if handle.exited.done() else None

    async def wait(self, handle: PodHandle) -> int:
        code = await asyncio.shield(handle.exited)
        if self._handles.pop(handle.name, None) is not None and not handle.deleting:
            # Ended on its own: its log is read, and a finished pod holds nothing worth keeping.
            handle.deleting = True
            await asyncio.to_thread(self._delete_pod_quietly, handle.name)
        return code

    async def stop(self, handle: PodHandle, grace: float = 5.0) -> None:
        if handle.ended:  # its exit is reported once its log is read (PodTracker.end): so is its stop
            await asyncio.shield(handle.exited)
            return
        handle.deleting = True
        await asyncio.to_thread(self._delete_pod, handle.name, grace)
        try:
            await asyncio.wait_for(asyncio.shield(handle.exited), grace + STOP_CONFIRM_SECONDS)
        except asyncio.TimeoutError:  # the watch said nothing: it is deleted, whatever it ended with
            unconfirmed = f"its pod {handle.name} was deleted; the API never confirmed its end"
            assert self._pods is not None  # a handle comes from start(), after attach()
            self._pods.end(handle, NO_EXIT_CODE, unconfirmed, ran=False)
            await asyncio.shield(handle.exited)

    def _delete_pod(self, name: str, grace: float) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self._core().delete_namespaced_pod(name, self.namespace, grace_period_seconds=math.ceil(grace))
        except ApiException as e:
            if e.status != 404:  # gone already: stopped
                raise BackendError(f"could not delete pod {name}: {api_message(e)}") from e

    def _delete_pod_quietly(self, name: str) -> None:
        try:
            self._delete_pod(name, 0)
        except BackendError as e:
            log.warning("cmlcluster: %s; the session's Secret going takes it (garbage collection)", e)

    def output(self, handle: PodHandle) -> str:
        return log_tail(handle.log_path)

    def exit_reason(self, handle: PodHandle) -> str | None:
        return handle.reason

    async def close(self) -> None:
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.stop()
        background, self._background = self._background, []
        for thread in background:
            await asyncio.to_thread(thread.join, 30)
        objects, self._objects = self._objects, None
        if objects is not None:
            await asyncio.to_thread(objects.delete)  # any pod left (none, after the stops) goes with its Secret
        if watching is not None:
            # A watch request ends within WATCH_SECONDS; the thread then sees the stop.
            await asyncio.to_thread(watching.join, WATCH_SECONDS + 20)


def delete_orphans(backend: KubernetesBackend | None = None, *, dry_run: bool = False) -> list[str]:
    """Delete what sessions that are gone left in the backend's namespace (orphans.py says when a
    session is gone); returns what was (or, with dry_run, would be) deleted, as "namespace/name"."""
    backend = backend or KubernetesBackend()
    return orphans.delete_orphans(
        backend._core(),
        backend.namespace,
        lambda name: backend._delete_pod(name, 0),
        dry_run=dry_run,
        networking=backend._networking(),
    )
