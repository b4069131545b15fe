"""The Kubernetes stand-in (tests/kubestandin), driven only through the official client, as the
Kubernetes backend drives it: pods run as Docker containers, watches, logs, garbage collection,
the scripted faults and RBAC denials. Its namespaces enforce Pod Security "restricted" and its pods
run as random uids (test_kube_restricted.py tests that), so the pods here are written to pass."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest

kubernetes = pytest.importorskip("kubernetes")
docker = pytest.importorskip("docker")

from kubernetes import watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from kubestandin import StandInCluster  # noqa: E402

pytestmark = pytest.mark.integration

IMAGE = "cmlcluster-test:latest"
FS_GROUP = 2000  # the test pods' fsGroup: it reads their Secrets, and owns the folders they write


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        docker.from_env(timeout=10).images.get(IMAGE)
    except Exception as e:
        pytest.skip(f"no Docker engine with {IMAGE}: {e}")
    shared = group_folder(tmp_path_factory.mktemp("claim"))
    with StandInCluster(claims={"shared": str(shared)}, node_cpu="4", node_memory="8Gi") as cluster:
        cluster.shared = shared
        yield cluster


@pytest.fixture(scope="module")
def api(cluster):
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cluster.configuration()))


def secret(name, data, labels=None):
    meta = {"name": name, "labels": labels or {}}
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": encoded}


def pod(name, command, *, owner=None, labels=None, volumes=(), mounts=(), **container):
    meta = {"name": name, "labels": labels or {"test": name}}
    if owner is not None:
        ref = {"apiVersion": "v1", "kind": "Secret", "name": owner.metadata.name, "uid": owner.metadata.uid}
        meta["ownerReferences"] = [{**ref, "controller": True, "blockOwnerDeletion": False}]
    spec = {"name": "worker", "image": IMAGE, "command": command, "volumeMounts": list(mounts), **container}
    spec.setdefault("resources", {"limits": {"cpu": "500m", "memory": "256Mi"}})
    # What Pod Security "restricted" asks of a pod (the stand-in's namespaces enforce it).
    spec.setdefault("securityContext", {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}})
    pod_spec = {"restartPolicy": "Never", "containers": [spec], "volumes": list(volumes)}
    pod_spec["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    pod_spec["securityContext"]["fsGroup"] = FS_GROUP
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def group_folder(path):
    """`path` made the test pods' to write, as an admin prepares an NFS export for a group: the
    stand-in's claims and mounts are host folders whose ownership no kubelet changes."""
    os.chown(path, -1, FS_GROUP)
    os.chmod(path, 0o2770)
    return path


def follow(api, name, until, timeout=30, since=None):
    """The pod's events (from resourceVersion `since`, or its current state first) until `until(type,
    pod)`; fails after `timeout`."""
    seen = []
    options = {"field_selector": f"metadata.name={name}", "timeout_seconds": timeout}
    if since is not None:
        options["resource_version"] = since
    stream = watch.Watch().stream(api.list_namespaced_pod, "default", **options)
    for event in stream:
        seen.append((event["type"], event["object"]))
        if until(event["type"], event["object"]):
            stream.close()
            return seen
        ended = event["object"].status.phase in ("Succeeded", "Failed")
        if ended and not event["object"].metadata.deletion_timestamp:  # it will not change: fail now
            stream.close()
            raise AssertionError(f"pod {name} ended: {event['object'].status}")
    raise AssertionError(f"pod {name} never got there in {timeout} s: {[(t, p.status.phase) for t, p in seen]}")


def waiting(pod):
    statuses = pod.status.container_statuses or []
    return statuses and statuses[0].state.waiting and statuses[0].state.waiting.reason


def terminated(pod):
    statuses = pod.status.container_statuses or []
    return statuses and statuses[0].state.terminated


def status_of(error: ApiException) -> dict:
    body = json.loads(error.body)
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == error.status
    return body


def test_version_namespaces_nodes_and_errors(cluster, api):
    client = kubernetes.client.ApiClient(cluster.configuration())
    assert kubernetes.client.VersionApi(client).get_code().git_version == "v1.31.0"
    assert api.read_namespace("default").status.phase == "Active"
    with pytest.raises(ApiException) as missing:
        api.read_namespace("nowhere")
    assert status_of(missing.value)["reason"] == "NotFound" and missing.value.status == 404
    with pytest.raises(ApiException) as no_namespace:
        api.create_namespaced_secret("nowhere", secret("x", {}))
    assert status_of(no_namespace.value)["message"] == 'namespaces "nowhere" not found'
    (node,) = api.list_node().items
    assert node.metadata.name == "standin-node" and node.status.allocatable["cpu"] == "4"
    assert "nvidia.com/gpu" not in node.status.capacity
    with pytest.raises(urllib.error.HTTPError) as unknown:
        urllib.request.urlopen(cluster.url + "/apis/apps/v1/namespaces/default/deployments", timeout=10)
    assert unknown.value.code == 404 and json.load(unknown.value)["kind"] == "Status"


def test_pod_life_log_labels_and_garbage_collection(cluster, api):
    owner = api.create_namespaced_secret("default", secret("life", {"key": "sekret"}, labels={"t": "life"}))
    with pytest.raises(ApiException) as again:
        api.create_namespaced_secret("default", secret("life", {"key": "sekret"}))
    assert again.value.status == 409 and status_of(again.value)["reason"] == "AlreadyExists"
    volume = {"name": "s", "secret": {"secretName": "life", "defaultMode": 0o400}}
    mount = {"name": "s", "mountPath": "/var/run/x", "readOnly": True}
    command = [
        "sh",
        "-c",
        "cat /var/run/x/key; echo; stat -c %a /var/run/x/key; echo out; echo err >&2; sleep 1; exit 3",
    ]
    created = api.create_namespaced_pod(
        "default", pod("life", command, owner=owner, volumes=[volume], mounts=[mount], labels={"t": "life"})
    )
    assert created.status.phase == "Pending" and created.metadata.uid and created.metadata.resource_version
    with pytest.raises(ApiException) as duplicate:
        api.create_namespaced_pod("default", pod("life", ["true"]))
    assert duplicate.value.status == 409
    with pytest.raises(ApiException) as no_image:
        api.create_namespaced_pod("default", pod("bad", ["true"], image=""))
    assert no_image.value.status == 422 and status_of(no_image.value)["reason"] == "Invalid"

    seen = follow(api, "life", lambda _, p: p.status.phase == "Running")
    # A followed log streams until the container exits (it sleeps 1 s before it does).
    followed = api.read_namespaced_pod_log("life", "default", follow=True, _preload_content=False)
    assert b"sekret" in followed.data and b"out" in followed.data
    seen += follow(api, "life", lambda _, p: p.status.phase == "Failed", since=seen[-1][1].metadata.resource_version)
    phases = [p.status.phase for _, p in seen]
    assert phases[0] == "Pending" and "Running" in phases and phases[-1] == "Failed", phases
    running = next(p for _, p in seen if p.status.phase == "Running")
    (container,) = cluster.containers()
    assert cluster.network_name in container.attrs["NetworkSettings"]["Networks"]
    subnet = docker.from_env().networks.get(cluster.network_name).attrs["IPAM"]["Config"][0]["Subnet"]
    assert ipaddress.ip_address(running.status.pod_ip) in ipaddress.ip_network(subnet)
    assert running.status.host_ip == cluster.gateway
    assert running.status.container_statuses[0].ready and running.status.container_statuses[0].state.running
    end = terminated(seen[-1][1])
    assert (end.exit_code, end.reason) == (3, "Error")
    versions = [int(p.metadata.resource_version) for _, p in seen]
    assert versions == sorted(set(versions)), versions

    log = api.read_namespaced_pod_log("life", "default")
    # Both streams (docker keeps no order between them); the Secret's file with its defaultMode, and
    # readable by the pod's fsGroup, which owns it (a kubelet adds group read where there is one).
    assert {"sekret", "440", "out", "err"} <= set(log.split("\n")), log
    assert api.read_namespaced_pod_log("life", "default", tail_lines=1).strip() in ("out", "err")

    assert [p.metadata.name for p in api.list_namespaced_pod("default", label_selector="t=life").items] == ["life"]
    assert api.list_namespaced_pod("default", label_selector="t=other").items == []
    assert [s.metadata.name for s in api.list_namespaced_secret("default", label_selector="t=life").items] == ["life"]

    # Deleting the Secret collects the pod it owns, and its container goes.
    since = api.list_namespaced_pod("default").metadata.resource_version
    answer = api.delete_namespaced_secret("life", "default")
    assert answer["kind"] == "Status" and answer["details"]["uid"] == owner.metadata.uid  # the client returns a dict
    follow(api, "life", lambda kind, _: kind == "DELETED", since=since)
    with pytest.raises(ApiException) as gone:
        api.read_namespaced_pod("life", "default")
    assert gone.value.status == 404 and status_of(gone.value)["details"] == {"name": "life", "kind": "pods"}
    assert cluster.containers() == []


def test_host_python_claim_env_and_missing_secret(cluster, api):
    """A pod that needs a Secret not there yet waits (CreateContainerConfigError), then runs when it
    comes: this host's Python, the claim as its working folder, its env and the Secret's file."""
    volumes = [
        {"name": "s", "secret": {"secretName": "later"}},
        {"name": "shared", "persistentVolumeClaim": {"claimName": "shared"}},
    ]
    mounts = [{"name": "s", "mountPath": "/var/run/later"}, {"name": "shared", "mountPath": "/shared"}]
    code = "import cmlcluster, os; open('out', 'w').write(os.environ['WHO'] + open('/var/run/later/k').read())"
    env = [{"name": "WHO", "value": "me:"}]
    api.create_namespaced_pod(
        "default",
        pod("later", [sys.executable, "-c", code], volumes=volumes, mounts=mounts, workingDir="/shared", env=env),
    )
    seen = follow(api, "later", lambda _, p: waiting(p) == "CreateContainerConfigError")
    assert seen[-1][1].status.container_statuses[0].state.waiting.message == 'secret "later" not found'
    with pytest.raises(ApiException) as not_started:
        api.read_namespaced_pod_log("later", "default")
    assert status_of(not_started.value)["message"] == (
        'container "worker" in pod "later" is waiting to start: CreateContainerConfigError'
    )
    api.create_namespaced_secret("default", secret("later", {"k": "yes"}))
    seen = follow(api, "later", lambda _, p: p.status.phase in ("Succeeded", "Failed"))
    assert seen[-1][1].status.phase == "Succeeded", api.read_namespaced_pod_log("later", "default")
    assert terminated(seen[-1][1]).reason == "Completed"
    assert (cluster.shared / "out").read_text() == "me:yes"
    api.delete_namespaced_pod("later", "default", grace_period_seconds=0)
    api.delete_namespaced_secret("later", "default")


def test_unschedulable_image_pull_and_oom_killed(cluster, api):
    cluster.fault_unschedulable(prefix="unsched")
    cluster.fault_image_pull(prefix="pull")
    cluster.fault_oom_killed(prefix="oom", after=1.0)
    gpu = {"limits": {"cpu": "1", "memory": "64Mi", "nvidia.com/gpu": "1"}}
    for name, resources in (("unsched", None), ("pull", None), ("oom", None), ("gpu", gpu)):
        extra = {"resources": resources} if resources else {}
        api.create_namespaced_pod("default", pod(name, ["sleep", "30"], **extra))

    for name, message in (
        ("unsched", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."),
        ("gpu", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: "),
    ):
        seen = follow(api, name, lambda _, p: any(c.reason == "Unschedulable" for c in p.status.conditions or []))
        condition = next(c for c in seen[-1][1].status.conditions if c.type == "PodScheduled")
        assert condition.status == "False" and condition.message.startswith(message), condition
        assert seen[-1][1].status.phase == "Pending" and not seen[-1][1].spec.node_name

    seen = follow(api, "pull", lambda _, p: waiting(p) == "ImagePullBackOff")
    reasons = [waiting(p) for _, p in seen]
    assert "ErrImagePull" in reasons or reasons[0] == "ImagePullBackOff"
    assert seen[-1][1].status.container_statuses[0].state.waiting.message == f'Back-off pulling image "{IMAGE}"'
    with pytest.raises(ApiException) as no_log:
        api.read_namespaced_pod_log("pull", "default")
    assert no_log.value.status == 400 and "is waiting to start" in status_of(no_log.value)["message"]

    seen = follow(api, "oom", lambda _, p: p.status.phase == "Failed")
    assert "Running" in [p.status.phase for _, p in seen]
    assert (terminated(seen[-1][1]).exit_code, terminated(seen[-1][1]).reason) == (137, "OOMKilled")

    cluster.clear_faults()
    for name in ("unsched", "pull", "oom", "gpu"):
        api.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    assert cluster.pods() == []


def test_deleted_by_someone_else_and_graceful_delete(cluster, api):
    api.create_namespaced_secret("default", secret("mine", {"a": "1"}))
    volume = {"name": "s", "secret": {"secretName": "mine"}}
    mount = {"name": "s", "mountPath": "/var/run/s"}
    api.create_namespaced_pod("default", pod("victim", ["sleep", "60"]))
    api.create_namespaced_pod("default", pod("mine", ["sleep", "60"], volumes=[volume], mounts=[mount]))
    for name in ("victim", "mine"):
        follow(api, name, lambda _, p: p.status.phase == "Running")
    assert api.read_namespaced_pod_status("mine", "default").status.phase == "Running"

    # A mounted Secret follows its changes (as the backend's SSH key, added later, needs).
    api.patch_namespaced_secret("mine", "default", {"data": {"b": base64.b64encode(b"2").decode()}})
    (mine,) = [c for c in cluster.containers() if c.labels["cmlcluster-standin.pod"] == "default/mine"]
    assert mine.exec_run(["sh", "-c", "cat /var/run/s/a /var/run/s/b"]).output == b"12"
    stream = watch.Watch().stream(api.list_namespaced_pod, "default", label_selector="test=victim", timeout_seconds=30)
    assert next(stream)["type"] == "ADDED"
    started = time.monotonic()
    cluster.delete_pod("victim")  # kubectl delete: TERM, which `sleep` under the init process obeys at once
    assert time.monotonic() - started < 10
    kinds = []
    for event in stream:
        kinds.append((event["type"], event["object"].metadata.deletion_timestamp is not None))
        if event["type"] == "DELETED":
            break
    assert kinds[0] == ("MODIFIED", True) and kinds[-1][0] == "DELETED", kinds
    assert [c.labels["cmlcluster-standin.pod"] for c in cluster.containers()] == ["default/mine"]

    marked = api.delete_namespaced_pod("mine", "default", grace_period_seconds=5)
    assert marked.metadata.deletion_timestamp is not None and marked.metadata.deletion_grace_period_seconds == 5
    seen = follow(api, "mine", lambda kind, _: kind == "DELETED")
    assert terminated(seen[-2][1]).exit_code in (137, 143) and seen[-2][1].status.phase == "Failed"
    assert cluster.containers() == []
    api.delete_namespaced_secret("mine", "default")


def test_restart_policy_on_failure(cluster, api):
    manifest = pod("again", ["sh", "-c", "echo run; exit 1"])
    manifest["spec"]["restartPolicy"] = "OnFailure"
    api.create_namespaced_pod("default", manifest)
    seen = follow(
        api, "again", lambda _, p: p.status.container_statuses and p.status.container_statuses[0].restart_count
    )
    status = seen[-1][1].status.container_statuses[0]
    assert status.last_state.terminated.exit_code == 1 and status.state.waiting.reason == "CrashLoopBackOff"
    assert seen[-1][1].status.phase == "Running"
    deleted = api.delete_collection_namespaced_pod("default", label_selector="test=again", grace_period_seconds=0)
    assert cluster.pods() == [] and cluster.containers() == [], deleted


def test_watch_dropped_resumes_and_compaction_expires(cluster, api):
    listed = api.list_namespaced_secret("default", label_selector="t=w")
    stream = watch.Watch().stream(
        api.list_namespaced_secret, "default", label_selector="t=w", resource_version=listed.metadata.resource_version
    )
    api.create_namespaced_secret("default", secret("w-a", {}, labels={"t": "w"}))
    first = next(stream)
    assert (first["type"], first["object"].metadata.name) == ("ADDED", "w-a")
    cluster.drop_watches()
    api.create_namespaced_secret("default", secret("w-b", {}, labels={"t": "w"}))
    api.create_namespaced_secret("default", secret("w-x", {}, labels={"t": "other"}))
    second = next(stream)  # the client resumed from the last resourceVersion it saw, and missed nothing
    assert (second["type"], second["object"].metadata.name) == ("ADDED", "w-b")
    stream.close()
    watches = [r for r in cluster.requests if r[1] == "/api/v1/namespaces/default/secrets" and r.query.get("watch")]
    assert [w.query["resourceVersion"] for w in watches[-2:]] == [
        listed.metadata.resource_version,
        first["object"].metadata.resource_version,
    ]

    # After compaction a watch from an older resourceVersion is Expired (410); list again and go on.
    old = api.list_namespaced_secret("default", label_selector="t=w").metadata.resource_version
    api.delete_namespaced_secret("w-a", "default")
    cluster.compact()
    url = f"{cluster.url}/api/v1/namespaces/default/secrets?watch=true&resourceVersion={old}"
    with urllib.request.urlopen(url, timeout=10) as answer:  # as the real API sends it: 200, an ERROR event
        (line,) = answer.read().splitlines()
    event = json.loads(line)
    assert event["type"] == "ERROR" and (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    with pytest.raises(ApiException) as expired:
        for _ in watch.Watch().stream(api.list_namespaced_secret, "default", resource_version=old, timeout_seconds=5):
            pass
    assert expired.value.status == 410 and expired.value.reason.startswith("Expired: too old resource version")
    fresh = api.list_namespaced_secret("default", label_selector="t=w")
    assert [s.metadata.name for s in fresh.items] == ["w-b"]
    stream = watch.Watch().stream(
        api.list_namespaced_secret, "default", label_selector="t=w", resource_version=fresh.metadata.resource_version
    )
    api.delete_namespaced_secret("w-b", "default")
    event = next(stream)
    assert (event["type"], event["object"].metadata.name) == ("DELETED", "w-b")
    stream.close()
    api.delete_collection_namespaced_secret("default", label_selector="t=other")
    assert api.list_namespaced_secret("default").items == []


def test_rbac_denials(cluster, api):
    auth = kubernetes.client.AuthorizationV1Api(kubernetes.client.ApiClient(cluster.configuration()))

    def allowed(verb, resource, subresource=None):
        attributes = {"namespace": "default", "verb": verb, "resource": resource}
        if subresource:
            attributes["subresource"] = subresource
        review = auth.create_self_subject_access_review({"spec": {"resourceAttributes": attributes}})
        return review.status.allowed

    cluster.deny("create", "pods")
    cluster.deny("get", "pods/log")
    try:
        assert not allowed("create", "pods") and not allowed("get", "pods", "log")
        assert allowed("list", "pods") and allowed("create", "secrets")
        with pytest.raises(ApiException) as forbidden:
            api.create_namespaced_pod("default", pod("nope", ["true"]))
        body = status_of(forbidden.value)
        assert forbidden.value.status == 403 and body["reason"] == "Forbidden"
        assert 'cannot create resource "pods" in API group "" in the namespace "default"' in body["message"]
        assert api.list_namespaced_pod("default").items == []
    finally:
        cluster.allow("create", "pods")
        cluster.allow("get", "pods/log")
    assert allowed("create", "pods")


def test_gpu_node_and_close_removes_everything(tmp_path):
    """A node with GPUs schedules a GPU pod (run without one); closing removes the containers, the
    Secret folders and the network it made; a new cluster removes a dead one's leftovers."""
    engine = docker.from_env(timeout=10)
    dead = {"cmlcluster-standin.pod": "default/old", "cmlcluster-standin.pid": "999999999"}
    leftover = engine.containers.create(IMAGE, ["true"], labels=dead)
    network = "cmlcluster-kube-closing"
    group_folder(tmp_path)
    with StandInCluster(network=network, node_gpus=1, mount_paths=[str(tmp_path)]) as cluster:
        assert not engine.containers.list(all=True, filters={"id": leftover.id})
        api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cluster.configuration()))
        assert api.list_node().items[0].status.allocatable["nvidia.com/gpu"] == "1"
        api.create_namespaced_secret("default", secret("s", {"k": "v"}))
        gpu = {"limits": {"cpu": "1", "memory": "64Mi", "nvidia.com/gpu": "1"}}
        volume, mount = {"name": "s", "secret": {"secretName": "s"}}, {"name": "s", "mountPath": "/s"}
        command = ["sh", "-c", f"cat /s/k > {tmp_path}/seen; sleep 60"]
        api.create_namespaced_pod("default", pod("gpu", command, resources=gpu, volumes=[volume], mounts=[mount]))
        follow(api, "gpu", lambda _, p: p.status.phase == "Running")
        (container,) = cluster.containers()
        assert container.labels["cmlcluster-standin.gpus"] == "1"
        folder = next(m["Source"] for m in container.attrs["Mounts"] if m["Destination"] == "/s")
        started = time.monotonic()
    assert time.monotonic() - started < 15
    assert (tmp_path / "seen").read_text() == "v"
    assert not engine.containers.list(all=True, filters={"label": "cmlcluster-standin.pod=default/gpu"})
    assert not os.path.exists(folder)
    assert not engine.networks.list(names=[network])
