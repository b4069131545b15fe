"""A stand-in Kubernetes cluster for tests: an API server on 127.0.0.1 (api.py) that the official
`kubernetes` client talks to over plain HTTP, and one node whose kubelet runs each pod as a Docker
container on a bridge network (kubelet.py). No Kubernetes installs here; this speaks its wire format
well enough for that client, and scripts the faults a real cluster shows.

    with StandInCluster(claims={"shared": str(tmp_path)}) as cluster:
        api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cluster.configuration()))

Least privilege by default, as a hardened cluster has it: every namespace enforces Pod Security
"restricted" (pod_security=; a pod that breaks it is refused with 403, podsecurity.py), and a pod
without runAsUser runs as a random non-root uid in group 0, with its fsGroup (random_uids=;
OpenShift's restricted SCC does the same). NetworkPolicies are stored, validated, and enforced with
iptables on the pods' bridge (netfilter.py) where the host allows it (`enforcing` says; root and
br_netfilter needed); `connection_allowed` says what they let through (netpol.py).

Everything it creates (containers, Secret folders, the network if it made it) is gone at exit;
containers carry the label cmlcluster-standin.pod=<ns>/<name>, and a new cluster removes those
whose process is dead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import docker
import psutil

from . import netfilter
from .api import Api, HttpServer, Store, Watcher
from .kubelet import GPU, LABEL, RANDOM_UIDS, Fault, Kubelet, host_python_mounts
from .netpol import connection_allowed

__all__ = ["RANDOM_UIDS", "StandInCluster"]

_LIVE: set[str] = set()  # this process's open clusters: their containers are not leftovers


class StandInCluster:
    def __init__(
        self,
        network: str = "",
        namespaces: Iterable[str] = ("default",),
        node_gpus: int = 0,
        node_cpu: str = "2",
        node_memory: str = "8Gi",
        node_storage: str = "1Ti",  # the node's ephemeral-storage: pods request some for their emptyDirs
        claims: Mapping[str, str] | None = None,
        host_python: bool = True,
        mount_paths: Iterable[str] = (),
        pod_security: str = "restricted",
        random_uids: bool = True,
        enforce_network_policies: bool = True,
    ):
        self.namespaces = tuple(namespaces)
        self.claims = dict(claims or {})
        self.id = uuid.uuid4().hex[:12]
        self.network_name = network or f"cmlcluster-kube-{self.id}"  # its own: clusters may run at once
        capacity = {"cpu": str(node_cpu), "memory": str(node_memory), "ephemeral-storage": node_storage, "pods": "110"}
        if node_gpus:
            capacity[GPU] = str(node_gpus)
        mounts: dict[str, tuple[str, str]] = {}
        if host_python:
            spec = importlib.util.find_spec("cmlcluster")
            assert spec is not None and spec.origin, "host_python: cmlcluster is not importable"
            mounts.update(host_python_mounts(os.path.dirname(spec.origin)))
        mounts.update({path: (path, "rw") for path in mount_paths})
        self._capacity, self._mounts = capacity, mounts
        self.pod_security, self.random_uids = pod_security, random_uids
        self.enforce_network_policies = enforce_network_policies
        self.enforcer: netfilter.Enforcer | None = None
        self.not_enforcing = ""  # why NetworkPolicies are not enforced, if they are not
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
            random_uids=self.random_uids,
        )
        self.api = Api(self.store, self.kubelet, self.namespaces, self.pod_security)
        self.not_enforcing = "enforce_network_policies=False"
        if self.enforce_network_policies:
            self.not_enforcing = netfilter.available()
        if not self.not_enforcing:
            self.enforcer = netfilter.Enforcer(self.id, self._bridge(), self._network_state)
            self.store.listeners.append(self.enforcer.changed)
            self.enforcer.start()
        self._server = HttpServer(self.api)
        self._server.thread.start()

    def close(self) -> None:
        if self.enforcer is not None:
            self.enforcer.close()
            self.enforcer = None
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
        """Containers (and iptables chains) of stand-ins whose process died (or closed without cleaning
        up, in this one)."""
        netfilter.remove_dead(psutil.pid_exists)
        for container in self._client.containers.list(all=True, filters={"label": f"{LABEL}.pod"}):
            labels = container.labels
            pid = int(labels.get(f"{LABEL}.pid", "0") or 0)
            mine = pid == os.getpid() and labels.get(f"{LABEL}.cluster") not in _LIVE
            if mine or not psutil.pid_exists(pid):
                with contextlib.suppress(docker.errors.APIError):
                    container.remove(force=True)

    def _bridge(self) -> str:
        """The Linux bridge of the cluster's Docker network (what its pods' traffic crosses)."""
        attrs = self._client.networks.get(self.network_name).attrs
        return (attrs.get("Options") or {}).get("com.docker.network.bridge.name") or f"br-{attrs['Id'][:12]}"

    def _network_state(self) -> tuple[list, list, dict]:
        """(pods, NetworkPolicies, {namespace: labels}) for the enforcer."""
        assert self.api is not None
        namespaces = {name: self.api._namespace(name)["metadata"]["labels"] for name in self.namespaces}
        return self.pods(), self.network_policies(), namespaces

    @property
    def enforcing(self) -> bool:
        """Whether NetworkPolicies are enforced on the pods' network (else `not_enforcing` says why)."""
        return self.enforcer is not None

    def wait_for_network_rules(self, timeout: float = 10) -> None:
        """Return once the enforcer has applied every change made so far (no-op when not enforcing)."""
        if self.enforcer is None:
            return
        target = self.enforcer.applied + 1
        self.enforcer.changed()
        deadline = time.monotonic() + timeout
        while self.enforcer.applied < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the network rules were not applied in {timeout} s: {self.enforcer.error}")
            time.sleep(0.05)

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

    def network_policies(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list("networkpolicies", namespace)[0]

    def set_pod_security(self, level: str, namespace: str = "default") -> None:
        """The namespace enforces Pod Security `level` from now on ("privileged": nothing), as
        `kubectl label ns <namespace> pod-security.kubernetes.io/enforce=<level>` does."""
        assert self.api is not None, "start() first"
        self.api.pod_security[namespace] = level

    def connection_allowed(
        self, destination: dict[str, Any], *, source_pod: dict[str, Any] | None = None, source_ip: str | None = None
    ) -> bool:
        """Whether the NetworkPolicies of the destination pod's namespace let a connection to it in from
        `source_pod` or `source_ip` (what a network plugin would decide; the stand-in enforces nothing)."""
        assert self.api is not None, "start() first"
        _, _, namespaces = self._network_state()
        policies = self.network_policies(destination["metadata"]["namespace"])
        return connection_allowed(policies, namespaces, destination, source_pod=source_pod, source_ip=source_ip)

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
