"""A stand-in Kubernetes cluster for tests: an API server on 127.0.0.1 (api.py) that the official
`kubernetes` client talks to over plain HTTP, and one node whose kubelet runs each pod as a Docker
container on a bridge network (kubelet.py). No Kubernetes installs here; this speaks its wire format
well enough for that client, and scripts the faults a real cluster shows.

    with StandInCluster(claims={"shared": str(tmp_path)}) as cluster:
        api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cluster.configuration()))

Everything it creates (containers, Secret folders, the network if it made it) is gone at exit;
containers carry the label cmlcluster-standin.pod=<ns>/<name>, and a new cluster removes those
whose process is dead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import docker
import psutil

from .api import Api, HttpServer, Store, Watcher
from .kubelet import GPU, LABEL, Fault, Kubelet, host_python_mounts

__all__ = ["StandInCluster"]

_LIVE: set[str] = set()  # this process's open clusters: their containers are not leftovers


class StandInCluster:
    def __init__(
        self,
        network: str = "",
        namespaces: Iterable[str] = ("default",),
        node_gpus: int = 0,
        node_cpu: str = "2",
        node_memory: str = "8Gi",
        claims: Mapping[str, str] | None = None,
        host_python: bool = True,
        mount_paths: Iterable[str] = (),
    ):
        self.namespaces = tuple(namespaces)
        self.claims = dict(claims or {})
        self.id = uuid.uuid4().hex[:12]
        self.network_name = network or f"cmlcluster-kube-{self.id}"  # its own: clusters may run at once
        capacity = {"cpu": str(node_cpu), "memory": str(node_memory), "pods": "110"}
        if node_gpus:
            capacity[GPU] = str(node_gpus)
        mounts: dict[str, tuple[str, str]] = {}
        if host_python:
            spec = importlib.util.find_spec("cmlcluster")
            assert spec is not None and spec.origin, "host_python: cmlcluster is not importable"
            mounts.update(host_python_mounts(os.path.dirname(os.path.dirname(spec.origin))))
        mounts.update({path: (path, "rw") for path in mount_paths})
        self._capacity, self._mounts = capacity, mounts
        self._client: Any = None
        self._created_network = False
        self._server: HttpServer | None = None
        self.store = Store()
        self.kubelet: Kubelet | None = None
        self.api: Api | None = None
        self.gateway = ""

    # ---------------------------------------------------------------- life

    def __enter__(self) -> StandInCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._client = docker.from_env(timeout=60, max_pool_size=64)
        self._remove_leftovers()
        self.gateway = self._ensure_network()
        _LIVE.add(self.id)
        self.kubelet = Kubelet(
            self.store,
            self._client,
            network=self.network_name,
            gateway=self.gateway,
            cluster_id=self.id,
            capacity=self._capacity,
            claims=self.claims,
            mounts=self._mounts,
        )
        self.api = Api(self.store, self.kubelet, self.namespaces)
        self._server = HttpServer(self.api)
        self._server.thread.start()

    def close(self) -> None:
        if self._server is not None:
            self.store.drop_watches()  # lets handlers blocked on a watch finish
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.api is not None:
            self.api.close()
        if self.kubelet is not None:
            self.kubelet.close()
        if self._client is not None:
            for container in self.containers():  # anything the kubelet lost track of
                with contextlib.suppress(docker.errors.APIError):
                    container.remove(force=True)
            if self._created_network:
                with contextlib.suppress(docker.errors.APIError):
                    self._client.networks.get(self.network_name).remove()
                self._created_network = False
            self._client.close()
            self._client = None
        _LIVE.discard(self.id)

    def _remove_leftovers(self) -> None:
        """Containers of stand-ins whose process died (or closed without cleaning up, in this one)."""
        for container in self._client.containers.list(all=True, filters={"label": f"{LABEL}.pod"}):
            labels = container.labels
            pid = int(labels.get(f"{LABEL}.pid", "0") or 0)
            mine = pid == os.getpid() and labels.get(f"{LABEL}.cluster") not in _LIVE
            if mine or not psutil.pid_exists(pid):
                with contextlib.suppress(docker.errors.APIError):
                    container.remove(force=True)

    def _ensure_network(self) -> str:
        try:
            network = self._client.networks.get(self.network_name)
        except docker.errors.NotFound:
            labels = {f"{LABEL}.network": "1"}
            network = self._client.networks.create(self.network_name, driver="bridge", labels=labels)
            self._created_network = True
            network.reload()
        configs = (network.attrs.get("IPAM") or {}).get("Config") or []
        gateways = [c["Gateway"] for c in configs if c.get("Gateway") and ":" not in c["Gateway"]]
        if not gateways:
            raise RuntimeError(f"network {self.network_name!r} has no IPv4 gateway")
        return str(gateways[0])

    # ---------------------------------------------------------------- for tests

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return self._server.url

    def configuration(self) -> Any:
        import kubernetes.client

        configuration = kubernetes.client.Configuration(host=self.url)
        configuration.verify_ssl = False
        return configuration

    @property
    def requests(self) -> list:
        """(method, path) of every request served, in order; each has `.query` too."""
        assert self.api is not None
        return self.api.requests

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list("pods", namespace)[0]

    def secrets(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list("secrets", namespace)[0]

    def delete_secret(self, name: str, namespace: str = "default") -> None:
        """Someone (or the garbage collector, its owner gone) deletes a Secret; what it owns goes too."""
        assert self.api is not None
        self.api._delete("secrets", namespace, name, {}, {})

    def set_node_gpus(self, count: int) -> None:
        """The node advertises `count` nvidia.com/gpu from now on (0: none)."""
        assert self.kubelet is not None
        with self.kubelet.lock:
            if count:
                self.kubelet.capacity[GPU] = str(count)
            else:
                self.kubelet.capacity.pop(GPU, None)

    def containers(self) -> list[Any]:
        return self._client.containers.list(all=True, filters={"label": f"{LABEL}.cluster={self.id}"})

    def fault_unschedulable(
        self, message: str = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.", prefix: str | None = None
    ) -> None:
        """Pods created from now on (named `prefix`..., or all) stay Pending: PodScheduled False, Unschedulable."""
        self._fault(Fault("unschedulable", prefix, message))

    def fault_image_pull(self, prefix: str | None = None) -> None:
        """Pods created from now on stay Pending, waiting with ErrImagePull, then ImagePullBackOff."""
        self._fault(Fault("image_pull", prefix))

    def fault_oom_killed(self, prefix: str | None = None, after: float = 1.0) -> None:
        """Containers of pods created from now on are killed `after` seconds running: exit 137, OOMKilled."""
        self._fault(Fault("oom_killed", prefix, after=after))

    def clear_faults(self) -> None:
        assert self.kubelet is not None
        with self.kubelet.lock:
            self.kubelet.faults.clear()

    def _fault(self, fault: Fault) -> None:
        assert self.kubelet is not None, "start() first"
        self.kubelet.add_fault(fault)

    def delete_pod(
        self, name: str, namespace: str = "default", grace_period_seconds: int | None = None, wait: float = 60
    ) -> None:
        """Someone else deletes a pod (kubectl delete: graceful); returns once it is gone (DELETED sent)."""
        assert self.api is not None
        if self.store.get("pods", namespace, name) is None:
            raise KeyError(f"no pod {namespace}/{name}")
        watcher = Watcher("pods", namespace, [], [("metadata.name", "=", name)])
        self.store.watch(watcher, str(self.store.rv))
        try:
            self.api.delete_pod(namespace, name, grace_period_seconds)
            while True:
                item = watcher.events.get(timeout=wait)
                if item is None or item[0] == "DELETED":
                    return
        except queue.Empty:
            raise TimeoutError(f"pod {namespace}/{name} still there after {wait} s") from None
        finally:
            self.store.unwatch(watcher)

    def drop_watches(self) -> None:
        """End every open watch stream now, as an API server restart does; clients must resume."""
        self.store.drop_watches()

    def compact(self) -> None:
        """Forget the event history: watching from an older resourceVersion gets 410 Gone (Expired)."""
        self.store.compact()

    def deny(self, verb: str, resource: str, namespace: str = "default") -> None:
        """RBAC says no: access reviews answer allowed=False, requests get 403 Forbidden. `resource`
        may name a subresource ("pods/log"); "*" matches anything; cluster-scoped resources take ""."""
        assert self.api is not None
        cluster_scoped = resource.split("/")[0] in ("nodes", "namespaces")
        self.api.denied.add((verb, resource, "" if cluster_scoped else namespace))

    def allow(self, verb: str, resource: str, namespace: str = "default") -> None:
        assert self.api is not None
        cluster_scoped = resource.split("/")[0] in ("nodes", "namespaces")
        self.api.denied.discard((verb, resource, "" if cluster_scoped else namespace))
