"""Workers as pods, placed by Kubernetes, through the official client.

One Secret per session (manifests.session_secret) carries the controller's connection info and
owns every worker pod; the backend deletes its pods itself, and Kubernetes' garbage collector
removes whatever a dead session left once the Secret goes (or once the notebook's own pod goes,
which owns the Secret when the notebook runs in a cluster).

What happens to pods is learnt from one watch of the session's pods (no polling loop): a watch
that drops is resumed from the last resourceVersion it delivered, and one whose history has been
compacted away (410 Gone) starts again from a fresh list. A pod fails with Kubernetes' own words
when it cannot be scheduled, its image cannot be pulled or its container cannot be created, when
it is evicted, OOM-killed, or deleted by someone else.

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
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...control import CONNECTION_ENV
from ...errors import BackendError, ConfigError
from ...ports import route_address
from ...registry import alive
from ...workers import Resources, WorkerSpec
from ..base import OUTPUT_DRAIN_SECONDS, Backend, Capabilities, SessionContext, log_tail, signal_exit_code
from . import manifests
from .manifests import PodOptions, SharedVolume

log = logging.getLogger("cmlcluster.kubernetes")

# A pod that ended without its container exiting (never scheduled, image never pulled, deleted
# before it ran) has no exit code; the contract needs one, and exit_reason says what happened.
NO_EXIT_CODE = 255
WATCH_SECONDS = 10  # each watch request ends after this long and is resumed: close() waits at most this
STOP_CONFIRM_SECONDS = 30.0  # after a pod's grace period, how long its deletion may take to show in the watch
IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# A container waiting for one of these reasons will not start without someone changing something.
# (Not ErrImagePull: a registry's rate limit or timeout is one too; the kubelet retries, and says
# ImagePullBackOff once the pull has failed again.)
FATAL_WAITING_REASONS = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
)
# What the backend does to pods and Secrets, checked before anything starts (SelfSubjectAccessReview).
NEEDED_ACCESS = (
    ("create", "pods", ""),
    ("get", "pods", ""),
    ("list", "pods", ""),
    ("watch", "pods", ""),
    ("delete", "pods", ""),
    ("get", "pods", "log"),
    ("create", "secrets", ""),
    ("delete", "secrets", ""),
)


@dataclass
class PodHandle:
    worker_id: str
    name: str
    log_path: str
    loop: asyncio.AbstractEventLoop  # the one that started it: what the watch says is handled there
    exited: asyncio.Future[int]
    reason: str | None = None  # why it ended, when its exit code does not say (exit_reason)
    deleting: bool = False  # by this backend: a stop, not someone else's kubectl delete
    deleted_by_other: bool = False  # the API marked it for deletion, and not on this backend's word
    ended: bool = False  # its end is known; exited resolves once its log is read
    ip: str | None = None
    log_thread: threading.Thread | None = None
    unschedulable: asyncio.TimerHandle | None = None  # fails it unless the scheduler places it meanwhile
    created_at: float | None = None  # when the API answered its create (monotonic)
    abandoned: bool = False  # its start failed or was cancelled: a pod created all the same is deleted


@dataclass
class _Watching:
    """One session's watch of its pods, stopped by that session's close() (never by the next attach)."""

    stop: threading.Event = field(default_factory=threading.Event)
    watch: Any = None  # the kubernetes.watch.Watch streaming now
    thread: threading.Thread | None = None


class KubernetesBackend(Backend):
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
        worker pod (see manifests.PodOptions).
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
        )
        if isinstance(wait_for_nodes, bool) or not isinstance(wait_for_nodes, (int, float)) or wait_for_nodes < 0:
            raise ConfigError(f"wait_for_nodes={wait_for_nodes!r}: give seconds, 0 or more")
        self.wait_for_nodes = float(wait_for_nodes)
        self.notebook_pod = notebook_pod
        self.python = python
        self._configuration = configuration
        self._in_cluster = False
        self._api: Any = None  # kubernetes.client.ApiClient
        self._checked = False
        self._handles: dict[str, PodHandle] = {}  # by pod name
        self._secret: dict[str, Any] | None = None  # the session's, once created
        self._secret_lock = threading.Lock()
        self._watching: _Watching | None = None
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
        if self._api is not None:
            return self._api
        try:
            from kubernetes import client, config
        except ImportError as e:
            raise ConfigError(
                f"the kubernetes backend needs the kubernetes client ({e}): pip install 'cmlcluster[kubernetes]'"
            ) from e
        configuration = self._configuration
        if configuration is None:
            configuration = client.Configuration()
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
                self._in_cluster = True
            else:
                try:
                    config.load_kube_config(client_configuration=configuration)
                except (config.ConfigException, OSError) as e:
                    raise ConfigError(
                        f"no Kubernetes cluster to use: not in a pod, and no kubeconfig ({e}). Point KUBECONFIG at "
                        "one (kubectl config view shows the current one), or pass configuration="
                    ) from None
        if self._namespace is None:
            self._namespace = _default_namespace(self._in_cluster)
        self._api = client.ApiClient(configuration)
        return self._api

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._connect())

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
        if not self.image:
            raise ConfigError(
                "image=None: give the worker image pods run, e.g. use_backend('kubernetes', "
                "image='registry.example.com/cmlcluster:1'), or set CMLCLUSTER_KUBERNETES_IMAGE"
            )
        self.controller_ip()
        if not self._checked:
            self._preflight()
            self._checked = True
        if resources.nvidia_gpu:
            self._check_gpus(resources.nvidia_gpu)

    def _preflight(self) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = self._connect()
        host = api.configuration.host
        core = client.CoreV1Api(api)
        try:
            core.read_namespace(self.namespace, _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(
                    f"namespace={self.namespace!r} does not exist on {host}; create it (kubectl create namespace "
                    f"{self.namespace}) or pass namespace="
                ) from None
            if e.status != 403:  # reading namespaces is not needed: the access review below says the rest
                raise _unexpected(f"reading namespace={self.namespace!r}", e) from None
        except Exception as e:  # connection refused, TLS, DNS
            raise ConfigError(
                f"the Kubernetes API at {host} did not answer ({e}); check the cluster and the kubeconfig's current "
                "context (kubectl cluster-info)"
            ) from None
        review = client.AuthorizationV1Api(api)
        for verb, resource, subresource in NEEDED_ACCESS:
            body = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(
                        namespace=self.namespace, verb=verb, resource=resource, subresource=subresource or None
                    )
                )
            )
            try:
                answer = review.create_self_subject_access_review(body, _request_timeout=10)
            except ApiException as e:
                raise _unexpected(f"asking whether this user may {verb} {resource}", e) from None
            verdict = answer.status
            if verdict is None or not verdict.allowed:
                what = f"{resource}/{subresource}" if subresource else resource
                why = f": {verdict.reason}" if verdict is not None and verdict.reason else ""
                raise ConfigError(
                    f"this Kubernetes user may not {verb} {what} in namespace {self.namespace!r}{why}; ask the "
                    f"cluster's admin for a Role that allows it (kubectl auth can-i {verb} {what} -n {self.namespace})"
                )
        if self.notebook_pod:
            try:
                core.read_namespaced_pod(self.notebook_pod, self.namespace, _request_timeout=10)
            except ApiException as e:
                if e.status == 404:
                    raise ConfigError(
                        f"notebook_pod={self.notebook_pod!r}: no such pod in namespace {self.namespace!r}; give the "
                        "name of the pod this notebook runs in (its HOSTNAME), or leave it out"
                    ) from None
                raise _unexpected(f"reading notebook_pod={self.notebook_pod!r}", e) from None
        for name in self.options.image_pull_secrets:
            try:
                core.read_namespaced_secret(name, self.namespace, _request_timeout=10)
            except ApiException as e:
                if e.status == 404:
                    raise ConfigError(
                        f"image_pull_secrets: Secret {name!r} does not exist in namespace {self.namespace!r}; create "
                        f"it (kubectl create secret docker-registry {name} ...) or leave it out"
                    ) from None
                if e.status != 403:  # may not read Secrets: the kubelet will say if it is missing
                    raise _unexpected(f"reading image pull Secret {name!r}", e) from None

    def _check_gpus(self, per_worker: int) -> None:
        from kubernetes.client.rest import ApiException

        try:
            nodes = self._core().list_node(_request_timeout=10).items
        except ApiException as e:
            if e.status == 403:
                return  # nodes are cluster-scoped and often not readable: the scheduler will say
            raise _unexpected(f"listing nodes to check nvidia_gpu={per_worker}", e) from None
        most = max((_quantity_int((n.status.allocatable or {}).get(manifests.GPU_RESOURCE)) for n in nodes), default=0)
        if most == 0:
            raise ConfigError(
                f"nvidia_gpu={per_worker}: no node of this cluster advertises {manifests.GPU_RESOURCE}; install the "
                "NVIDIA device plugin on its GPU nodes, or ask for nvidia_gpu=0"
            )
        if per_worker > most:
            raise ConfigError(
                f"nvidia_gpu={per_worker}: the node with the most GPUs has {most}; ask for {most} or fewer per worker"
            )

    # ---------------------------------------------------------------- session

    async def attach(self, context: SessionContext) -> None:
        await super().attach(context)
        await asyncio.to_thread(self._connect)
        self._secret = None
        self._handles = {}
        watching = self._watching = _Watching()
        watching.thread = threading.Thread(
            target=self._watch_pods, args=(watching,), name="cmlcluster-kubernetes-watch", daemon=True
        )
        watching.thread.start()

    def _ensure_secret(self, connection_info: str) -> dict[str, Any]:
        """{"name", "uid"} of the session's Secret, created by the first start (on a thread)."""
        with self._secret_lock:
            if self._secret is None:
                body = manifests.session_secret(
                    self.context.session_id,
                    namespace=self.namespace,
                    connection_info=connection_info,
                    owner=self._notebook_pod(),
                    origin=(socket.gethostname(), os.getpid()),
                )
                created = self._core().create_namespaced_secret(self.namespace, body)
                self._secret = {"name": created.metadata.name, "uid": created.metadata.uid}
            return self._secret

    def _notebook_pod(self) -> dict[str, str] | None:
        """{"name", "uid"} of the pod this notebook runs in, to own the session's Secret; None outside one."""
        name = self.notebook_pod or (os.environ.get("HOSTNAME", "") if self._in_cluster else "")
        if not name:
            return None
        from kubernetes.client.rest import ApiException

        try:
            pod = self._core().read_namespaced_pod(name, self.namespace, _request_timeout=10)
        except ApiException as e:
            log.warning(
                "cmlcluster: could not read this notebook's pod %r (%s): its workers will not go with it if it dies",
                name,
                e.reason,
            )
            return None
        return {"name": pod.metadata.name, "uid": pod.metadata.uid}

    async def start(self, spec: WorkerSpec) -> PodHandle:
        from kubernetes.client.rest import ApiException

        try:
            secret = await asyncio.to_thread(self._ensure_secret, spec.env[CONNECTION_ENV])
        except ApiException as e:
            raise BackendError(f"could not create the session's Secret: {_api_message(e)}") from e
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
        log_dir = os.path.join(self.context.session_dir, "workers")
        os.makedirs(log_dir, exist_ok=True)
        handle = PodHandle(
            worker_id=spec.worker_id,
            name=name,
            log_path=os.path.join(log_dir, f"{spec.worker_id}.log"),
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
            raise BackendError(f"could not create pod {name} for worker {spec.worker_id}: {_api_message(e)}") from e
        except BaseException as e:
            # Cancelled, or the connection broke: the pod may exist all the same, and must not stay.
            self._handles.pop(name, None)
            handle.abandoned = True
            if created.done():  # else create() deletes it once the API has answered
                self._in_background(lambda: self._delete_pod_quietly(name), f"cmlcluster-delete-{spec.worker_id}")
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

    # ---------------------------------------------------------------- what the watch says

    def _watch_pods(self, watching: _Watching) -> None:
        """The session's pods, as the API reports them, handed to the session's loop (own thread)."""
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        core = self._core()
        selector = manifests.session_selector(self.context.session_id)
        version: str | None = None
        failures = 0
        while not watching.stop.is_set():
            try:
                if version is None:  # the first time, and after history was compacted away (410)
                    listed_at = time.monotonic()
                    pods = core.list_namespaced_pod(self.namespace, label_selector=selector, _request_timeout=15)
                    for pod in pods.items:
                        self._report("MODIFIED", pod)
                    self._report_missing({pod.metadata.name for pod in pods.items}, listed_at)
                    version = pods.metadata.resource_version
                watching.watch = watch.Watch()
                for event in watching.watch.stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=WATCH_SECONDS,
                    allow_watch_bookmarks=True,
                    _request_timeout=WATCH_SECONDS + 20,
                ):
                    if watching.stop.is_set():
                        return
                    if event["type"] != "BOOKMARK":  # a bookmark only moves the resourceVersion on
                        self._report(event["type"], event["object"])
                    failures = 0
                version = watching.watch.resource_version or version  # the stream ended: resume where it was
            except ApiException as e:
                if e.status == 410:  # too old to resume: list again
                    version = None
                    continue
                failures += 1
                log.warning("cmlcluster: the watch of this session's pods failed (%s); resuming", _api_message(e))
            except Exception as e:  # the connection dropped
                if watching.stop.is_set():
                    return
                failures += 1
                if watching.watch is not None and watching.watch.resource_version:
                    version = watching.watch.resource_version
                log.debug("cmlcluster: the watch of this session's pods broke (%s); resuming", e)
            watching.stop.wait(min(5.0, 0.2 * 2**failures) if failures else 0)

    def _report_missing(self, listed: set[str], listed_at: float) -> None:
        """Pods that a fresh list no longer has were deleted while the watch could not say so."""
        for handle in list(self._handles.values()):
            if handle.created_at is not None and handle.created_at < listed_at and handle.name not in listed:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                    handle.loop.call_soon_threadsafe(self._on_missing, handle)

    def _on_missing(self, handle: PodHandle) -> None:
        gone = f"its pod {handle.name} is gone (deleted while the watch of the session's pods was down)"
        self._end(handle, NO_EXIT_CODE, None if handle.deleted_by_other else gone, ran=False)

    def _report(self, kind: str, pod: Any) -> None:
        handle = self._handles.get(pod.metadata.name)
        if handle is not None and not handle.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                handle.loop.call_soon_threadsafe(self._on_pod, kind, pod)

    def _on_pod(self, kind: str, pod: Any) -> None:
        """One event about one pod, on the session's loop."""
        handle = self._handles.get(pod.metadata.name)
        if handle is None or handle.ended:
            return
        status = pod.status
        state = _container_state(pod)
        # A deletion shows first as a deletionTimestamp, then the container stops, then the pod goes.
        if pod.metadata.deletion_timestamp is not None and not handle.deleting:
            handle.deleted_by_other = True
        if kind == "DELETED":
            terminated = state.terminated if state is not None else None
            if terminated is not None:
                self._end(handle, terminated.exit_code, _termination_reason(terminated, pod))
            else:
                gone = None if handle.deleted_by_other else f"its pod {handle.name} was deleted"  # _end says by whom
                self._end(handle, NO_EXIT_CODE, gone, ran=False)
            return
        if status is None:
            return
        if status.pod_ip and handle.ip is None:
            handle.ip = status.pod_ip
        if status.phase in ("Succeeded", "Failed"):
            terminated = state.terminated if state is not None else None
            if terminated is not None:
                self._end(handle, terminated.exit_code, _termination_reason(terminated, pod))
            else:  # evicted before its container ran, say
                why = _pod_reason(pod) or f"its pod {handle.name} {status.phase.lower()}"
                self._end(handle, NO_EXIT_CODE, why, ran=False)
            return
        if state is not None and state.running is not None:
            self._follow_log(handle)
        if state is not None and state.waiting is not None and state.waiting.reason in FATAL_WAITING_REASONS:
            self._give_up(handle, f"{state.waiting.reason}: {state.waiting.message or 'no message'}")
            return
        unschedulable = _unschedulable(pod)
        if unschedulable is not None and handle.unschedulable is None:
            reason = f"Unschedulable: {unschedulable}"
            if self.wait_for_nodes:
                reason += f" (for {self.wait_for_nodes:g} s: wait_for_nodes)"
            handle.unschedulable = handle.loop.call_later(self.wait_for_nodes, self._give_up, handle, reason)
        elif unschedulable is None and handle.unschedulable is not None and (pod.spec and pod.spec.node_name):
            handle.unschedulable.cancel()  # placed after all (a node was added): it starts
            handle.unschedulable = None

    def _give_up(self, handle: PodHandle, reason: str) -> None:
        """A pod that will not run as it is: it fails with `reason`, and is deleted."""
        if handle.ended:
            return
        self._end(handle, NO_EXIT_CODE, reason, ran=False)
        handle.deleting = True
        # On a thread of its own, not the loop's executor: close() may run on another loop.
        self._in_background(lambda: self._delete_pod_quietly(handle.name), f"cmlcluster-delete-{handle.worker_id}")

    def _end(self, handle: PodHandle, code: int | None, reason: str | None, ran: bool = True) -> None:
        """The pod is done: its exit is reported once its output has been read (output() for messages)."""
        if handle.ended:
            return
        handle.ended = True
        if handle.unschedulable is not None:
            handle.unschedulable.cancel()
        if handle.deleted_by_other:
            reason = "; ".join(filter(None, [f"its pod {handle.name} was deleted by someone else", reason]))
        handle.reason = reason
        final = _contract_code(code)

        def report(_: object = None) -> None:
            if not handle.exited.done():
                handle.exited.set_result(final)

        if ran:
            self._follow_log(handle)  # a container that ended before the watch saw it run: its whole log
        if handle.log_thread is None:
            report()
            return
        # The contract's wait(): the exit is reported once the pod's log has been read to its end.
        drained = asyncio.ensure_future(asyncio.to_thread(handle.log_thread.join, OUTPUT_DRAIN_SECONDS))
        drained.add_done_callback(report)

    def _follow_log(self, handle: PodHandle) -> None:
        if handle.log_thread is None:
            handle.log_thread = threading.Thread(
                target=self._copy_log, args=(handle,), name=f"cmlcluster-log-{handle.worker_id}", daemon=True
            )
            handle.log_thread.start()

    def _copy_log(self, handle: PodHandle) -> None:
        """The container's output into the worker's log file, from its start to its end (own thread)."""
        with contextlib.suppress(Exception), open(handle.log_path, "ab") as out:
            response = self._core().read_namespaced_pod_log(
                handle.name,
                self.namespace,
                container=manifests.CONTAINER_NAME,
                follow=True,
                _preload_content=False,
            )
            try:
                for chunk in response.stream(4096):
                    out.write(chunk)
                    out.flush()
            finally:
                response.release_conn()

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
        if handle.ended:  # its exit is reported once its log is read (_end): so is its stop
            await asyncio.shield(handle.exited)
            return
        handle.deleting = True
        await asyncio.to_thread(self._delete_pod, handle.name, grace)
        try:
            await asyncio.wait_for(asyncio.shield(handle.exited), grace + STOP_CONFIRM_SECONDS)
        except asyncio.TimeoutError:  # the watch said nothing: it is deleted, whatever it ended with
            unconfirmed = f"its pod {handle.name} was deleted; the API never confirmed its end"
            self._end(handle, NO_EXIT_CODE, unconfirmed, ran=False)
            await asyncio.shield(handle.exited)

    def _delete_pod(self, name: str, grace: float) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self._core().delete_namespaced_pod(name, self.namespace, grace_period_seconds=math.ceil(grace))
        except ApiException as e:
            if e.status != 404:  # gone already: stopped
                raise BackendError(f"could not delete pod {name}: {_api_message(e)}") from e

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
            watching.stop.set()
            if watching.watch is not None:
                watching.watch.stop()
                response = getattr(watching.watch, "_resp", None)  # a blocked read ends when its socket does
                if response is not None:
                    with contextlib.suppress(Exception):
                        response.shutdown()
        background, self._background = self._background, []
        for thread in background:
            await asyncio.to_thread(thread.join, 30)
        secret, self._secret = self._secret, None
        if secret is not None:
            # Any pod left (none, after the session's stops) goes with it: the garbage collector.
            try:
                await asyncio.to_thread(
                    self._core().delete_namespaced_secret,
                    secret["name"],
                    self.namespace,
                    propagation_policy="Background",
                )
            except Exception as e:  # not found (deleted already), or the API is gone
                log.warning("cmlcluster: could not delete the session's Secret %s: %s", secret["name"], e)
        if watching is not None and watching.thread is not None:
            # A watch request ends within WATCH_SECONDS; the thread then sees the stop.
            await asyncio.to_thread(watching.thread.join, WATCH_SECONDS + 20)


# ---------------------------------------------------------------- reading pods


def _container_state(pod: Any) -> Any:
    statuses = (pod.status.container_statuses if pod.status is not None else None) or []
    for status in statuses:
        if status.name == manifests.CONTAINER_NAME:
            return status.state
    return None


def _termination_reason(terminated: Any, pod: Any) -> str | None:
    reason = terminated.reason
    if reason == "OOMKilled":
        limit = _memory_limit(pod)
        return f"OOMKilled: it used more than its memory limit{f' of {limit}' if limit else ''}"
    if reason in (None, "Error", "Completed"):  # the exit code says it
        return _pod_reason(pod)
    return f"{reason}: {terminated.message}" if terminated.message else reason


def _pod_reason(pod: Any) -> str | None:
    """Why the pod as a whole ended (Evicted, DeadlineExceeded...), if it says."""
    status = pod.status
    if status is None or not status.reason:
        return None
    return f"{status.reason}: {status.message}" if status.message else status.reason


def _unschedulable(pod: Any) -> str | None:
    """The scheduler's message for a pod it cannot place, else None."""
    for condition in (pod.status.conditions if pod.status is not None else None) or []:
        if condition.type == "PodScheduled" and condition.status == "False" and condition.reason == "Unschedulable":
            return condition.message or "no node fits the pod"
    return None


def _memory_limit(pod: Any) -> str | None:
    for container in pod.spec.containers if pod.spec is not None else []:
        if container.name == manifests.CONTAINER_NAME and container.resources and container.resources.limits:
            return container.resources.limits.get("memory")
    return None


def _contract_code(code: int | None) -> int:
    """A container killed by signal N exits 128+N (the runtime's convention); the contract says -N."""
    if code is None:
        return NO_EXIT_CODE
    return signal_exit_code(int(code))


def _quantity_int(value: Any) -> int:
    try:
        return int(str(value)) if value is not None else 0
    except ValueError:
        return 0


def _unexpected(doing: str, e: Any) -> ConfigError:
    """An answer the checks did not expect, refused before anything starts with the API's words."""
    return ConfigError(
        f"{doing}, the Kubernetes API answered {e.status}: {_api_message(e)}; check the cluster and this user's "
        "access (kubectl auth can-i --list)"
    )


def _api_message(e: Any) -> str:
    """The API's own message from an ApiException (its Status body), else its reason."""
    import json

    try:
        return str(json.loads(e.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"


def _default_namespace(in_cluster: bool) -> str:
    if in_cluster:
        with contextlib.suppress(OSError), open(IN_CLUSTER_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
        return "default"
    from kubernetes import config

    with contextlib.suppress(Exception):
        _, active = config.list_kube_config_contexts()
        return str(active["context"].get("namespace") or "default")
    return "default"


def delete_orphans(backend: KubernetesBackend | None = None, *, dry_run: bool = False) -> list[str]:
    """Delete the Secrets of this host's sessions whose process is gone; their pods go with them
    (the garbage collector; deleted here too, so that nothing waits for it). Returns what was
    (or, with dry_run, would be) deleted, as "namespace/name". Sessions of other hosts are left alone.
    """
    backend = backend or KubernetesBackend()
    core = backend._core()
    selector = f"{manifests.MANAGED_BY_LABEL}={manifests.MANAGER},{manifests.COMPONENT_LABEL}=session"
    host = socket.gethostname()
    ended = []
    for secret in core.list_namespaced_secret(backend.namespace, label_selector=selector, _request_timeout=30).items:
        notes = secret.metadata.annotations or {}
        if notes.get(manifests.HOST_ANNOTATION) != host or alive(int(notes.get(manifests.PID_ANNOTATION, "0"))):
            continue
        session = (secret.metadata.labels or {}).get(manifests.SESSION_LABEL, "")
        pods = core.list_namespaced_pod(
            backend.namespace, label_selector=f"{manifests.SESSION_LABEL}={session}", _request_timeout=30
        ).items
        ended += [f"{backend.namespace}/{pod.metadata.name}" for pod in pods]
        ended.append(f"{backend.namespace}/{secret.metadata.name}")
        if not dry_run:
            for pod in pods:
                backend._delete_pod(pod.metadata.name, 0)
            with contextlib.suppress(Exception):
                core.delete_namespaced_secret(secret.metadata.name, backend.namespace)
    return ended
