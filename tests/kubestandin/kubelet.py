"""The stand-in's node: a scheduler and kubelet for one node that run each pod's container with Docker.

One thread per pod walks it through what a kubelet reports: scheduled (or Unschedulable), Pending
with the container waiting (ContainerCreating, ErrImagePull, CreateContainerConfigError), Running
with its IP on the network, then terminated with docker's exit code (OOMKilled from docker's
State.OOMKilled). The thread waits on the container with docker's `wait`, never by polling.
Every change goes through the store, so clients see it as a watch event.

Containers run as their securityContext says (user_of): as runAsUser, or, where none is set, as a
random uid from RANDOM_UIDS with group 0, as OpenShift's restricted SCC runs pods; the fsGroup and
supplementalGroups join the process's groups, and own the pod's Secret and emptyDir folders (as a
kubelet's volume ownership management does: group read for Secrets, setgid and group write for
emptyDirs). Capabilities dropped and allowPrivilegeEscalation=false become docker's cap_drop and
no-new-privileges. Claims are the host's folders as they are, like NFS volumes, whose ownership no
kubelet changes. An emptyDir's sizeLimit is not enforced.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import platform
import random
import re
import shutil
import stat
import sys
import tempfile
import threading
import uuid
from decimal import Decimal
from typing import Any

import docker
import docker.errors

from cmlcluster.backends.base import run_tag_labels

from .api import ApiError, Store, invalid, now

NODE = "standin-node"
# Where a pod without runAsUser gets its uid when the kubelet assigns one (OpenShift's ranges start
# at 1000000000): high, and never a user of the host's.
RANDOM_UIDS = range(1_000_000_000, 2_000_000_000)
LABEL = "cmlcluster-standin"  # container labels: .pod=<ns>/<name>, .uid, .cluster, .pid
GPU = "nvidia.com/gpu"
_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIXES.update({"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1, "k": 10**3})
_SUFFIXES.update({"M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18})
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+))?(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?")


def parse_quantity(text: Any) -> Decimal:
    """A Kubernetes quantity ("1500m", "0.5", "2Gi", "512Mi", "1e3") as a number; ValueError if not one."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if not match:
        raise ValueError(
            f"quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {text!r}"
        )
    number, exponent, suffix = match.groups()
    value = Decimal(number) * (Decimal(10) ** int(exponent or 0))
    return value * Decimal(_SUFFIXES[suffix or ""])


@dataclasses.dataclass
class Fault:
    kind: str  # "unschedulable", "image_pull", "oom_killed"
    prefix: str | None
    message: str = ""
    after: float = 1.0  # oom_killed: seconds of running before the kill


class _Missing(Exception):  # a referenced Secret or key is not there (yet)
    def __init__(self, message: str, secret: str, absent: bool = True):
        super().__init__(message)
        self.secret, self.absent = secret, absent  # absent: the Secret itself, not one of its keys


@dataclasses.dataclass(eq=False)
class PodRuntime:
    """The kubelet's side of one pod; `lock` orders container create/start against deletion."""

    uid: str
    namespace: str
    name: str
    fault: Fault | None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    deleting: threading.Event = dataclasses.field(default_factory=threading.Event)
    container: Any = None
    image_id: str = ""
    ip: str = ""
    bound: bool = False
    live: bool = False  # started and not yet seen exiting
    ever_started: bool = False
    done: bool = False
    restarts: int = 0
    waiting_for: str | None = None  # the Secret a CreateContainerConfigError waits for
    killed_for_oom: bool = False
    folders: dict[str, tuple[str, str, dict]] = dataclasses.field(default_factory=dict)  # volume: (secret, dir, source)
    fs_group: int | None = None  # the pod's fsGroup: it owns the Secret's files and emptyDirs
    timers: list[threading.Timer] = dataclasses.field(default_factory=list)


class Kubelet:
    def __init__(
        self,
        store: Store,
        client: docker.DockerClient,
        *,
        network: str,
        gateway: str,
        cluster_id: str,
        capacity: dict[str, str],
        claims: dict[str, str],
        mounts: dict[str, tuple[str, str]],  # container path: (host path, "ro" or "rw")
        random_uids: bool = True,
    ):
        self.store, self.client, self.network, self.gateway = store, client, network, gateway
        self.cluster_id, self.capacity, self.claims, self.mounts = cluster_id, capacity, claims, mounts
        self.pods: dict[str, PodRuntime] = {}
        self.faults: list[Fault] = []
        self.lock = threading.RLock()  # scheduling decisions, the pods and faults tables
        self.unschedulable: list[PodRuntime] = []
        self.node_uid, self.node_created = str(uuid.uuid4()), now()
        self.closing = False
        self.random_uids = random_uids  # a pod without runAsUser runs as a random uid, else as the image's user

    # ---------------------------------------------------------------- the node

    def node(self) -> dict[str, Any]:
        labels = {"kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
        if int(self.capacity.get(GPU, "0")):
            labels["nvidia.com/gpu.present"] = "true"
        info = dict.fromkeys(("machineID", "systemUUID", "bootID"), self.node_uid)
        info.update(kernelVersion=platform.release(), osImage="kubestandin", operatingSystem="linux")
        info.update(architecture="amd64", containerRuntimeVersion="docker://" + docker.__version__)
        info.update(kubeletVersion="v1.31.0", kubeProxyVersion="v1.31.0")
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
        }
        ready.update(lastHeartbeatTime=now(), lastTransitionTime=self.node_created)
        meta = {"name": NODE, "uid": self.node_uid, "resourceVersion": "1", "creationTimestamp": self.node_created}
        status = {"capacity": dict(self.capacity), "allocatable": dict(self.capacity), "conditions": [ready]}
        status.update(
            addresses=[{"type": "InternalIP", "address": self.gateway}, {"type": "Hostname", "address": NODE}]
        )
        status["nodeInfo"] = info
        return {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {**meta, "labels": labels},
            "spec": {},
            "status": status,
        }

    # ---------------------------------------------------------------- admission (the API calls these)

    def admit(self, pod: dict[str, Any]) -> None:
        """The API's defaulting and validation of a new pod (422 for what the stand-in cannot run)."""
        name = pod["metadata"]["name"]
        spec = pod.setdefault("spec", {})
        containers = spec.get("containers") or []
        if len(containers) != 1 or spec.get("initContainers"):
            raise invalid("Pod", name, "spec.containers", "Unsupported value: the stand-in runs exactly one container")
        volumes = {v.get("name"): v for v in spec.get("volumes") or []}
        for v in volumes.values():
            if not {"secret", "persistentVolumeClaim", "emptyDir"} & set(v):
                raise invalid("Pod", name, "spec.volumes", "Unsupported value: secret, persistentVolumeClaim, emptyDir")
            v.get("secret", {}).setdefault("defaultMode", 0o644)
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        for i, c in enumerate(containers):
            where = f"spec.containers[{i}]"
            for key in ("name", "image"):
                if not c.get(key):
                    raise invalid("Pod", name, f"{where}.{key}", "Required value")
            for j, mount in enumerate(c.get("volumeMounts") or []):
                if mount.get("name") not in volumes:
                    raise invalid("Pod", name, f"{where}.volumeMounts[{j}].name", f'Not found: "{mount.get("name")}"')
            resources = c.setdefault("resources", {})
            for kind in ("limits", "requests"):
                for resource, amount in (resources.get(kind) or {}).items():
                    try:
                        parse_quantity(amount)
                    except ValueError as e:
                        raise invalid(
                            "Pod", name, f"{where}.resources.{kind}[{resource}]", f"Invalid value: {e}"
                        ) from None
            # Requests default to limits, as the API does.
            resources["requests"] = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            tag = c["image"].rpartition("/")[2]
            c.setdefault("imagePullPolicy", "Always" if ":" not in tag or tag.endswith(":latest") else "IfNotPresent")
        limits, requests = containers[0]["resources"].get("limits") or {}, containers[0]["resources"]["requests"]
        guaranteed = all(r in limits and limits[r] == requests.get(r) for r in ("cpu", "memory"))
        qos = "Guaranteed" if guaranteed else "Burstable" if requests else "BestEffort"
        pod["status"] = {"phase": "Pending", "qosClass": qos}

    def pod_created(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with self.lock:
            fault = next(
                (f for f in reversed(self.faults) if f.prefix is None or meta["name"].startswith(f.prefix)), None
            )
            rt = PodRuntime(meta["uid"], meta["namespace"], meta["name"], fault)
            self.pods[rt.uid] = rt
        self._go(rt)

    def running(self, uid: str) -> bool:
        rt = self.pods.get(uid)
        return rt is not None and rt.live

    def terminate(self, uid: str, grace: int) -> None:
        """Graceful deletion: stop the container (TERM, KILL after `grace`); the pod's thread then
        reports the exit and removes the pod."""
        rt = self.pods.get(uid)
        if rt is None:
            return
        with rt.lock:
            rt.deleting.set()
            live, container = rt.live, rt.container
        if live:
            _thread(f"stop-{rt.name}", lambda: _quietly(container.stop, timeout=grace))
        else:
            _thread(f"finalize-{rt.name}", self._finalize, rt)

    def forget(self, uid: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Delete the pod now (grace 0, or nothing running): its container killed and removed, then
        the pod (DELETED); the deleted pod, or None if it was gone."""
        rt = self.pods.get(uid)
        if rt is None:
            return self.store.delete("pods", namespace, name, uid=uid)
        rt.deleting.set()
        return self._finalize(rt)

    def secret_changed(self, namespace: str, name: str) -> None:
        """A Secret was created, changed or deleted: mounted copies follow it (a deleted one's files stay,
        as on a kubelet), and pods waiting for it start."""
        secret = self.store.get("secrets", namespace, name)
        with self.lock:
            pods = [rt for rt in self.pods.values() if rt.namespace == namespace]
        for rt in pods:
            for secret_name, folder, source in list(rt.folders.values()):
                if secret_name == name and secret is not None:
                    with contextlib.suppress(_Missing, OSError):
                        _write_secret(folder, secret, source, rt.fs_group)
            if secret is not None:
                self._wake(rt, name)

    def _wake(self, rt: PodRuntime, secret: str) -> None:
        with self.lock:  # once: secret_changed() and _start() may both see it come
            if rt.waiting_for != secret or rt.deleting.is_set():
                return
            rt.waiting_for = None
        self._go(rt)

    def log(self, pod: dict[str, Any], *, follow: bool, tail: int | None) -> Any:
        name, container = pod["metadata"]["name"], pod["spec"]["containers"][0]["name"]
        if not pod["spec"].get("nodeName"):
            return iter([])  # the API answers an unscheduled pod's log with nothing
        rt = self.pods.get(pod["metadata"]["uid"])
        if rt is None or rt.container is None or not rt.ever_started:
            statuses = pod.get("status", {}).get("containerStatuses") or [{}]
            reason = statuses[0].get("state", {}).get("waiting", {}).get("reason", "ContainerCreating")
            if reason in ("ErrImagePull", "ImagePullBackOff"):
                reason = "trying and failing to pull image"
            raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: {reason}')
        options = {"stdout": True, "stderr": True, "tail": "all" if tail is None else tail}
        if follow:
            return rt.container.logs(stream=True, follow=True, **options)
        return iter([rt.container.logs(**options)])

    # ---------------------------------------------------------------- faults

    def add_fault(self, fault: Fault) -> None:
        with self.lock:
            self.faults.append(fault)

    # ---------------------------------------------------------------- a pod's life

    def _go(self, rt: PodRuntime) -> None:
        _thread(f"pod-{rt.name}", self._run, rt)

    def _run(self, rt: PodRuntime) -> None:
        try:
            if rt.bound or self._schedule(rt):
                self._start(rt)
        except Exception as e:  # shown in the pod, not lost in a thread; a deleted pod's errors are expected
            if not rt.deleting.is_set() and not self.closing:
                self._report(rt, "Pending", {"waiting": {"reason": "StandInError", "message": repr(e)}})

    def _schedule(self, rt: PodRuntime) -> bool:
        with self.lock:
            pod = self.store.get("pods", rt.namespace, rt.name)
            if pod is None or rt.deleting.is_set():
                return False
            faulted = rt.fault is not None and rt.fault.kind == "unschedulable"
            problem = rt.fault.message if faulted and rt.fault else self._fit(pod)

            def change(obj: dict[str, Any]) -> None:
                if not problem:
                    obj["spec"]["nodeName"] = NODE
                _condition(obj["status"], "PodScheduled", not problem, "Unschedulable" if problem else None, problem)

            self.store.update("pods", rt.namespace, rt.name, change, uid=rt.uid)
            if problem and not faulted and rt not in self.unschedulable:
                self.unschedulable.append(rt)  # tried again when resources free up
            rt.bound = not problem
            return rt.bound

    def _fit(self, pod: dict[str, Any]) -> str:
        """Why the node cannot take `pod` now, in the scheduler's words; "" if it can."""
        tail = "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
        for volume in pod["spec"].get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in self.claims:
                return f'0/1 nodes are available: persistentvolumeclaim "{claim}" not found. {tail}'
        labels = self.node()["metadata"]["labels"]
        if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
            return f"0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector. {tail}"
        used = {r: Decimal(0) for r in self.capacity}
        for other in self.store.list("pods")[0]:
            if other["spec"].get("nodeName") == NODE and other["status"].get("phase") not in ("Succeeded", "Failed"):
                for r, amount in _requests(other).items():
                    used[r] = used.get(r, Decimal(0)) + amount
                used["pods"] += 1
        wanted = {**_requests(pod), "pods": Decimal(1)}
        short = sorted(
            r for r, amount in wanted.items() if used.get(r, 0) + amount > parse_quantity(self.capacity.get(r, 0))
        )
        if not short:
            return ""
        reasons = ", ".join(f"1 Insufficient {r}" if r != "pods" else "1 Too many pods" for r in short)
        victims = "preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod."
        return f"0/1 nodes are available: {reasons}. {victims}"

    def _reschedule(self) -> None:
        with self.lock:
            waiting, self.unschedulable = self.unschedulable, []
        for rt in waiting:
            if not rt.deleting.is_set() and not self.closing and self._schedule(rt):
                self._go(rt)

    def _start(self, rt: PodRuntime) -> None:
        pod = self.store.get("pods", rt.namespace, rt.name)
        if pod is None or rt.deleting.is_set():
            return
        spec = pod["spec"]
        c = spec["containers"][0]
        self._report(rt, "Pending", {"waiting": {"reason": "ContainerCreating"}})
        try:
            if rt.fault is not None and rt.fault.kind == "image_pull":
                raise docker.errors.ImageNotFound("scripted fault")
            rt.image_id = self.client.images.get(c["image"]).id
        except docker.errors.ImageNotFound:
            message = f'failed to pull and unpack image "{c["image"]}": not found (the stand-in pulls nothing)'
            self._report(rt, "Pending", {"waiting": {"reason": "ErrImagePull", "message": message}})
            if not rt.deleting.wait(1):
                message = f'Back-off pulling image "{c["image"]}"'
                self._report(rt, "Pending", {"waiting": {"reason": "ImagePullBackOff", "message": message}})
            return
        try:
            user, groups = self._user_of(pod, c)
            binds, env = self._prepare(rt, pod)
        except _Refused as e:
            self._report(rt, "Pending", {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}})
            return
        except _Missing as e:
            self._report(rt, "Pending", {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}})
            with self.lock:
                rt.waiting_for = e.secret  # secret_changed() starts it again when the Secret comes or changes
            if e.absent and self.store.get("secrets", rt.namespace, e.secret) is not None:
                self._wake(rt, e.secret)  # it came meanwhile
            return
        limits = c["resources"].get("limits") or {}
        labels = {f"{LABEL}.pod": f"{rt.namespace}/{rt.name}", f"{LABEL}.uid": rt.uid}
        labels.update({f"{LABEL}.cluster": self.cluster_id, f"{LABEL}.pid": str(os.getpid()), **run_tag_labels()})
        if limits.get(GPU):
            labels[f"{LABEL}.gpus"] = str(limits[GPU])  # recorded only: no GPU here
        options: dict[str, Any] = {
            "image": c["image"],
            "name": f"kube-{rt.namespace}-{rt.name}-{rt.uid[:8]}",
            "hostname": rt.name[:63],
            "entrypoint": c.get("command") or None,  # Kubernetes' command replaces the image's entrypoint
            "command": c.get("args") or None,
            "environment": env,
            "working_dir": c.get("workingDir") or None,
            "network": self.network,
            "labels": labels,
            "volumes": [f"{host}:{path}:{mode}" for path, (host, mode) in binds.items()],
            "init": True,  # the pause container's part: PID 1 reaps orphans and forwards signals
            "user": user,
            "group_add": groups,
            **_confinement(c.get("securityContext") or {}, spec.get("securityContext") or {}),
        }
        if limits.get("cpu"):
            options["nano_cpus"] = int(parse_quantity(limits["cpu"]) * 10**9)
        if limits.get("memory"):
            options["mem_limit"] = int(parse_quantity(limits["memory"]))
        with rt.lock:
            if rt.deleting.is_set():
                return
            try:
                rt.container = self.client.containers.create(**options)
            except docker.errors.APIError as e:
                message = str(e.explanation or e)
                self._report(rt, "Pending", {"waiting": {"reason": "CreateContainerError", "message": message}})
                return
        self._live(rt, spec)

    def _live(self, rt: PodRuntime, spec: dict[str, Any]) -> None:
        """Start the container, report it running, wait for its exit; restart it as restartPolicy says."""
        while True:
            with rt.lock:
                if rt.deleting.is_set():
                    break
                try:
                    rt.container.start()
                    rt.live = rt.ever_started = True
                    failed = None
                except docker.errors.APIError as e:
                    failed = str(e.explanation or e)
            if failed is not None:
                code = 128
                terminated = {"exitCode": code, "reason": "StartError", "message": failed, "finishedAt": now()}
            else:
                if rt.fault is not None and rt.fault.kind == "oom_killed":
                    timer = threading.Timer(rt.fault.after, self._oom_kill, (rt,))
                    timer.daemon = True
                    rt.timers.append(timer)
                    timer.start()
                rt.container.reload()
                network = rt.container.attrs["NetworkSettings"]["Networks"].get(self.network) or {}
                rt.ip = network.get("IPAddress") or rt.ip
                started = _time(rt.container.attrs["State"]["StartedAt"])
                if rt.container.attrs["State"]["Running"]:  # a container that is done already goes straight on
                    self._report(rt, "Running", {"running": {"startedAt": started}}, ready=True)
                code = int(rt.container.wait(timeout=None)["StatusCode"])
                rt.live = False
                rt.container.reload()
                state = rt.container.attrs["State"]
                reason = "Completed" if code == 0 else "Error"
                if state.get("OOMKilled") or rt.killed_for_oom:
                    reason = "OOMKilled"
                terminated = {"exitCode": code, "reason": reason, "startedAt": started}
                terminated.update(finishedAt=_time(state["FinishedAt"]), containerID="docker://" + rt.container.id)
            policy = spec.get("restartPolicy", "Always")
            if rt.deleting.is_set() or self.closing or policy == "Never" or (policy == "OnFailure" and code == 0):
                self._report(rt, "Succeeded" if code == 0 else "Failed", {"terminated": terminated})
                break
            rt.restarts += 1
            back_off = {"reason": "CrashLoopBackOff", "message": f"back-off restarting failed container {rt.name}"}
            self._report(rt, "Running", {"waiting": back_off}, last_state={"terminated": terminated})
            if rt.deleting.wait(min(0.5 * 2**rt.restarts, 10)):  # the kubelet's back-off, shortened
                break
        with rt.lock:
            rt.done, deleting = True, rt.deleting.is_set()
        self._reschedule()
        if deleting:
            self._finalize(rt)

    def _oom_kill(self, rt: PodRuntime) -> None:
        rt.killed_for_oom = True
        _quietly(rt.container.kill, signal="SIGKILL")

    def _user_of(self, pod: dict[str, Any], c: dict[str, Any]) -> tuple[str, list[str]]:
        """docker's "uid:gid" and extra groups for the container, from its and the pod's securityContext;
        _Refused when runAsNonRoot is asked for and it would run as root (the kubelet's check)."""
        pod_context, context = pod["spec"].get("securityContext") or {}, c.get("securityContext") or {}
        uid = context.get("runAsUser", pod_context.get("runAsUser"))
        gid = context.get("runAsGroup", pod_context.get("runAsGroup"))
        if uid is None and self.random_uids:
            uid = random.choice(RANDOM_UIDS)
            gid = 0 if gid is None else gid  # OpenShift's arbitrary uids are in the root group
        if uid is None:
            image_user = (self.client.images.get(c["image"]).attrs.get("Config") or {}).get("User") or "0"
            uid = image_user.partition(":")[0]
        non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if non_root and str(uid) in ("0", "root"):
            raise _Refused("container has runAsNonRoot and image will run as root")
        groups = [pod_context.get("fsGroup"), *(pod_context.get("supplementalGroups") or [])]
        user = str(uid) if gid is None else f"{uid}:{gid}"
        return user, [str(g) for g in groups if g is not None]

    def _prepare(self, rt: PodRuntime, pod: dict[str, Any]) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        """The container's mounts ({container path: (host path, mode)}) and environment; _Missing if a
        Secret (or a key of one) it needs is not there."""
        c = pod["spec"]["containers"][0]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        binds = dict(self.mounts)
        rt.fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        for mount in c.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            mode = "ro" if mount.get("readOnly") else "rw"
            if "persistentVolumeClaim" in volume:
                binds[mount["mountPath"]] = (self.claims[volume["persistentVolumeClaim"]["claimName"]], mode)
                continue
            if volume["name"] not in rt.folders:
                folder = tempfile.mkdtemp(prefix="kubestandin-")
                # A Secret's folder is readable by all (its files carry their own modes); an emptyDir
                # is anyone's to write, as a kubelet makes it (0777).
                secret_folder = "secret" in volume
                _own(folder, 0o755 if secret_folder else 0o777, rt.fs_group, directory=True, read_only=secret_folder)
                source = volume.get("secret") or {}
                rt.folders[volume["name"]] = (source.get("secretName", ""), folder, source)
            secret_name, folder, source = rt.folders[volume["name"]]
            if "secret" in volume:
                secret = self.store.get("secrets", rt.namespace, secret_name)
                if secret is None and not source.get("optional"):
                    raise _Missing(f'secret "{secret_name}" not found', secret_name)
                if secret is not None:
                    _write_secret(folder, secret, source, rt.fs_group)
                mode = "ro"  # Secret volumes are always read-only
            binds[mount["mountPath"]] = (folder, mode)
        env = {}
        for var in c.get("env") or []:
            env[var["name"]] = self._env_value(rt, pod, var)
        return binds, env

    def _env_value(self, rt: PodRuntime, pod: dict[str, Any], var: dict[str, Any]) -> str:
        source = var.get("valueFrom")
        if not source:
            return str(var.get("value", ""))
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = self.store.get("secrets", rt.namespace, ref["name"])
            data = (secret or {}).get("data") or {}
            if ref["key"] not in data:
                if ref.get("optional"):
                    return ""
                if secret is None:
                    raise _Missing(f'secret "{ref["name"]}" not found', ref["name"])
                message = f"couldn't find key {ref['key']} in Secret {rt.namespace}/{ref['name']}"
                raise _Missing(message, ref["name"], absent=False)
            return base64.b64decode(data[ref["key"]]).decode()
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            labels = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
            if labels:
                return (pod["metadata"].get(labels[1]) or {}).get(labels[2], "")
            values = {"metadata.name": rt.name, "metadata.namespace": rt.namespace, "metadata.uid": rt.uid}
            values.update({"spec.nodeName": NODE, "status.hostIP": self.gateway, "status.podIP": rt.ip})
            return values.get(path, "")
        return ""

    def _report(
        self,
        rt: PodRuntime,
        phase: str,
        state: dict[str, Any],
        *,
        ready: bool = False,
        last_state: dict[str, Any] | None = None,
    ) -> None:
        """Write the kubelet's view of the pod into its status (one MODIFIED event)."""

        def change(pod: dict[str, Any]) -> None:
            c = pod["spec"]["containers"][0]
            status = pod["status"]
            status["phase"] = phase
            status.update(hostIP=self.gateway, hostIPs=[{"ip": self.gateway}])
            status.setdefault("startTime", now())
            if rt.ip:
                status.update(podIP=rt.ip, podIPs=[{"ip": rt.ip}])
            container = {"name": c["name"], "image": c["image"], "imageID": rt.image_id, "ready": ready}
            container.update(started="running" in state, restartCount=rt.restarts, state=state)
            if rt.container is not None:
                container["containerID"] = "docker://" + rt.container.id
            if last_state:
                container["lastState"] = last_state
            status["containerStatuses"] = [container]
            terminal = phase in ("Succeeded", "Failed")
            not_ready = "PodCompleted" if terminal else "ContainersNotReady"
            unready = None if terminal else f"containers with unready status: [{c['name']}]"
            _condition(status, "PodReadyToStartContainers", rt.container is not None and not terminal)
            _condition(status, "Initialized", True)
            for kind in ("Ready", "ContainersReady"):
                _condition(status, kind, ready, None if ready else not_ready, None if ready else unready)
            _condition(status, "PodScheduled", True)

        self.store.update("pods", rt.namespace, rt.name, change, uid=rt.uid)

    def _finalize(self, rt: PodRuntime) -> dict[str, Any] | None:
        """The end of a deleted pod: its container and folders removed, then out of the API (DELETED),
        as a kubelet confirms the containers are gone before the API drops a gracefully deleted pod."""
        for timer in rt.timers:
            timer.cancel()
        with rt.lock:
            container = rt.container
        if container is not None:
            _remove(container)
        for _, folder, _ in rt.folders.values():
            shutil.rmtree(folder, ignore_errors=True)
        gone = self.store.delete("pods", rt.namespace, rt.name, uid=rt.uid)
        with self.lock:
            self.pods.pop(rt.uid, None)
            if rt in self.unschedulable:
                self.unschedulable.remove(rt)
        self._reschedule()
        return gone

    def close(self) -> None:
        """Stop then remove every container, remove every folder."""
        self.closing = True
        with self.lock:
            pods = list(self.pods.values())
        for rt in pods:
            rt.deleting.set()
            for timer in rt.timers:
                timer.cancel()

        def stop(rt: PodRuntime) -> None:
            with rt.lock:
                container = rt.container
            if container is not None:
                _quietly(container.stop, timeout=1)
                _remove(container)
            for _, folder, _ in rt.folders.values():
                shutil.rmtree(folder, ignore_errors=True)

        threads = [_thread(f"close-{rt.name}", stop, rt) for rt in pods]
        for thread in threads:
            thread.join(timeout=60)


def host_python_mounts(package: str) -> dict[str, tuple[str, str]]:
    """What docker/backend.py's host_python mounts: /usr, this Python's prefixes and the cmlcluster package
    (not its checkout's root, which may be private to root: pods run as random uids)."""
    mounts = {"/usr": ("/usr", "ro")}
    for path in (sys.base_prefix, sys.prefix, package):
        if not path.startswith("/usr/"):
            mounts.setdefault(path, (path, "ro"))
    return mounts


def _requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    total: dict[str, Decimal] = {}
    for c in pod["spec"]["containers"]:
        for resource, amount in ((c.get("resources") or {}).get("requests") or {}).items():
            total[resource] = total.get(resource, Decimal(0)) + parse_quantity(amount)
    return total


def _condition(status: dict[str, Any], kind: str, value: bool, reason: str | None = None, message: str | None = None):
    """Set a pod condition, keeping its lastTransitionTime while its status stays."""
    conditions = status.setdefault("conditions", [])
    found = next((c for c in conditions if c["type"] == kind), None)
    new = {"type": kind, "status": "True" if value else "False", "lastProbeTime": None}
    new["lastTransitionTime"] = found["lastTransitionTime"] if found and found["status"] == new["status"] else now()
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    if found is None:
        conditions.append(new)
    else:
        conditions[conditions.index(found)] = new


def _own(path: str, mode: int, fs_group: int | None, *, directory: bool = False, read_only: bool = False) -> None:
    """A volume's file or folder as a kubelet leaves it: `mode`, and with an fsGroup, that group's and
    readable by it (writable too unless read_only; folders setgid and searchable), so that a process
    with any uid in the group reads (or writes) it."""
    if fs_group is not None:
        os.chown(path, -1, fs_group)
        mode |= 0o440 if read_only else 0o660
        if directory:
            mode |= 0o110 | stat.S_ISGID
    os.chmod(path, mode)


def _confinement(context: dict[str, Any], pod_context: dict[str, Any]) -> dict[str, Any]:
    """docker's options for a container's securityContext: capabilities, privilege escalation,
    seccomp (docker's default profile is the runtime's default), privileged."""
    options: dict[str, Any] = {}
    capabilities = context.get("capabilities") or {}
    if capabilities.get("drop"):
        options["cap_drop"] = list(capabilities["drop"])
    if capabilities.get("add"):
        options["cap_add"] = list(capabilities["add"])
    security = []
    if context.get("allowPrivilegeEscalation") is False:
        security.append("no-new-privileges")
    seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
    if seccomp == "Unconfined":
        security.append("seccomp=unconfined")
    if security:
        options["security_opt"] = security
    if context.get("privileged"):
        options["privileged"] = True
    return options


class _Refused(Exception):  # the kubelet will not run the container as its securityContext says
    pass


def _write_secret(folder: str, secret: dict[str, Any], source: dict[str, Any], fs_group: int | None = None) -> None:
    """A Secret's data as files (mode from defaultMode or the item; with an fsGroup, owned by it and
    readable by it, as a kubelet does), replaced atomically so that a reader never sees half a
    file; keys no longer in the Secret disappear."""
    data, mode = secret.get("data") or {}, source.get("defaultMode", 0o644)
    if source.get("items"):
        missing = [i["key"] for i in source["items"] if i["key"] not in data]
        if missing:
            raise _Missing(f"references non-existent secret key: {missing[0]}", secret["metadata"]["name"], False)
        files = {i["path"]: (data[i["key"]], i.get("mode", mode)) for i in source["items"]}
    else:
        files = {key: (value, mode) for key, value in data.items()}
    for old in os.listdir(folder):
        if old not in files:
            _quietly(os.remove, os.path.join(folder, old))
    for path, (value, file_mode) in files.items():
        target = os.path.join(folder, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = os.path.join(os.path.dirname(target), f"..{os.path.basename(target)}.tmp")
        with open(partial, "wb") as f:
            f.write(base64.b64decode(value))
        _own(partial, file_mode, fs_group, read_only=True)
        os.replace(partial, target)


def _time(docker_time: str) -> str:
    """Docker's nanosecond timestamps as the API's RFC 3339 seconds."""
    return docker_time[:19] + "Z" if docker_time and not docker_time.startswith("0001") else now()


def _remove(container: Any) -> None:
    """Kill and remove a container; if a removal is under way already (the pod's thread and a
    deletion both finalize it), wait for that one to finish."""
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError:
        _quietly(container.wait, condition="removed", timeout=60)


def _quietly(function: Any, *args: Any, **kwargs: Any) -> None:
    with contextlib.suppress(Exception):
        function(*args, **kwargs)


def _thread(name: str, target: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=f"kubestandin-{name}", daemon=True)
    thread.start()
    return thread
