"""The kubernetes backend end to end, through the official client, against the stand-in cluster of
tests/kubestandin (a Kubernetes API on 127.0.0.1 whose "kubelet" runs each pod as a Docker
container): workers as pods with their own addresses, resources and the session's Secret, the
failures Kubernetes reports (unschedulable, image pull, OOMKilled, deleted by someone else), a
watch that drops or whose history is compacted, and the checks made before anything starts.

What this does not test: a real API server's admission, scheduling and kubelet (none installs
here; see docs/guide/backends.md, "What was tested, and what was not").
"""

from __future__ import annotations

import base64
import json
import secrets
import signal
import subprocess
import sys

import ipyparallel as ipp
import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, kube_backend
from harness.processes import wait_until
from kubernetes.client import ApiClient, CoreV1Api

from cmlcluster import Session
from cmlcluster.backends.kubernetes import names
from cmlcluster.backends.kubernetes.backend import delete_orphans
from cmlcluster.errors import ConfigError

pytestmark = pytest.mark.integration


@pytest.fixture
def kube_session(kube):
    with Session(kube_backend(kube), echo=False) as s:
        yield s
    kube.clear_faults()
    # Nothing of the session is left on the cluster: no pod, no container, no Secret, no NetworkPolicy.
    wait_until(lambda: not kube.pods() and not kube.containers(), timeout=30, what="the session's pods to go")
    assert not [s for s in kube.secrets() if s["metadata"]["name"].startswith("cmlcluster-")]
    assert not kube.network_policies()


def pod_of(kube, worker_id):
    return next(p for p in kube.pods() if p["metadata"]["name"] == names.pod_name(worker_id))


def failure_of(session, worker, timeout=90):
    done = session.await_workers([worker], timeout_seconds=timeout)
    assert done["failures"], done
    return done["failures"][0]


def test_workers_are_pods_with_their_own_addresses_resources_and_the_secret_as_files(kube, kube_session):
    session = kube_session
    marker = f"cmlc-marker-{secrets.token_hex(12)}"
    workers = session.launch_workers(2, cpu=0.5, memory=1, env={"CMLC_MARKER": marker})
    running = session.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
    assert running["failures"] == []
    ips = [w["ip_address"] for w in running["workers"]]
    pods = [pod_of(kube, w["id"]) for w in workers]
    assert ips == [p["status"]["podIP"] for p in pods] and len(set(ips)) == 2 and "127.0.0.1" not in ips

    secret = next(s for s in kube.secrets() if s["metadata"]["name"] == names.secret_name(session.id))
    # env= is in the session's Secret, one key per worker, and the pods only reference it.
    assert marker not in json.dumps(pods)
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items() if k.startswith("env.")}
    assert sorted(values.values()) == [marker, marker] and len(values) == 2
    for pod in pods:
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"] == {"cpu": "500m", "memory": "1Gi"}
        assert container["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": "10Gi"}
        # the connection info is a file, never an environment variable
        env_names = {e["name"] for e in container["env"]}
        assert "CMLCLUSTER_CONNECTION_FILE" in env_names and "CMLCLUSTER_CONNECTION" not in env_names
        assert pod["metadata"]["ownerReferences"][0]["uid"] == secret["metadata"]["uid"]

    # In the worker: the key came from the mounted Secret, read-only to its owner and the pod's fsGroup
    # (the worker's uid is the cluster's pick), and is not in the environment that user code (and
    # every process it starts) sees.
    seen = session.client[:].apply_sync(
        ipp.interactive(
            lambda: (
                sorted(k for k in __import__("os").environ if k.startswith("CMLCLUSTER_CONNECTION")),
                oct(__import__("os").stat("/var/run/cmlcluster/connection.json").st_mode & 0o777),
                __import__("os").environ.get("CMLC_MARKER"),
            )
        )
    )
    assert seen == [([], "0o440", marker)] * 2

    stopped = session.stop_workers()
    assert [w["status"] for w in stopped] == ["stopped"] * 2
    assert [w["exit_code"] for w in stopped] == [-signal.SIGTERM] * 2


def test_a_pod_that_cannot_be_scheduled_fails_with_the_schedulers_message(kube, kube_session):
    kube.fault_unschedulable("0/1 nodes are available: 1 Insufficient cpu.", prefix=f"cmlcluster-{kube_session.id}")
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1)
    failure = failure_of(kube_session, worker)
    assert "Unschedulable: 0/1 nodes are available: 1 Insufficient cpu." in failure["message"]
    wait_until(lambda: not kube.pods(), timeout=30, what="the unschedulable pod to be deleted")


def test_an_image_that_cannot_be_pulled_fails_with_the_kubelets_reason(kube, kube_session):
    kube.fault_image_pull(prefix=f"cmlcluster-{kube_session.id}")
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1)
    failure = failure_of(kube_session, worker)
    # Not at the first ErrImagePull (a registry's hiccup is one too): once the kubelet backs off.
    assert "ImagePullBackOff: Back-off pulling image" in failure["message"]


def test_a_worker_over_its_memory_limit_fails_as_oomkilled(kube_session):
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=0.25, code="x = bytearray(1 << 30)\nprint(len(x))")
    failure = failure_of(kube_session, worker)
    assert failure["exit_code"] == -signal.SIGKILL
    assert "OOMKilled: it used more than its memory limit of 256Mi" in failure["message"]


def test_a_pod_deleted_by_someone_else_fails_its_worker_saying_so(kube, kube_session):
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1)
    kube_session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
    kube.delete_pod(names.pod_name(worker["id"]))
    failure = failure_of(kube_session, worker)
    assert "deleted by someone else" in failure["message"]


def pod_lists(kube):
    """How many times pods were listed (not watched)."""
    return sum(1 for r in kube.requests if r == ("GET", "/api/v1/namespaces/default/pods") and "watch" not in r.query)


def test_a_dropped_watch_resumes_from_its_resource_version(kube, kube_session):
    code = "import time\ntime.sleep(4)\nraise SystemExit(3)"
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1, code=code)
    kube_session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
    lists = pod_lists(kube)
    kube.drop_watches()
    failure = failure_of(kube_session, worker)
    assert failure["exit_code"] == 3, failure
    # (The program's exit came over the control plane.) The backend saw the pod end through its
    # resumed watch: an ended pod is deleted once its exit is known, while the session goes on.
    wait_until(lambda: not kube.pods(), timeout=30, what="the ended pod to be deleted")
    assert pod_lists(kube) == lists  # resumed, not listed again: nothing was missed


def test_a_watch_whose_history_was_compacted_lists_again(kube, kube_session):
    kube.fault_oom_killed(prefix=f"cmlcluster-{kube_session.id}", after=8)
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1)
    kube_session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
    lists = pod_lists(kube)
    kube.deny("watch", "pods")  # the watch cannot come back while the pod is OOM-killed...
    try:
        kube.drop_watches()
        wait_until(lambda: pod_of(kube, worker["id"])["status"]["phase"] == "Failed", timeout=60, what="the kill")
        kube.compact()  # ...and compaction forgets it: the resumed watch gets 410 Gone, then a list
    finally:
        kube.allow("watch", "pods")
    failure = failure_of(kube_session, worker)
    assert failure["exit_code"] == -signal.SIGKILL and "OOMKilled" in failure["message"], failure
    assert pod_lists(kube) == lists + 1


# ---------------------------------------------------------------- before anything starts


def pods_created(kube):
    return [path for method, path in kube.requests if method == "POST" and path.endswith("/pods")]


@pytest.mark.parametrize(
    ("options", "arrange", "says"),
    [
        ({"namespace": "nowhere"}, None, ["namespace='nowhere' does not exist", "kubectl create namespace nowhere"]),
        ({}, ("deny", "create", "pods"), ["may not create pods in namespace 'default'", "kubectl auth can-i"]),
        ({}, ("deny", "patch", "secrets"), ["may not patch secrets", "add each worker's env= values"]),
        ({}, ("deny", "delete", "secrets"), ["may not delete secrets", "kubectl auth can-i delete secrets -n default"]),
        ({}, ("deny", "create", "networkpolicies"), ["may not create networkpolicies.networking.k8s.io"]),
        ({"image_pull_secrets": ["registry-login"]}, None, ["Secret 'registry-login' does not exist"]),
        ({"controller_ip": None}, None, ["controller_ip=None", "CMLCLUSTER_KUBERNETES_CONTROLLER_IP"]),
        ({"image": None}, None, ["image=None"]),
        ({"notebook_pod": "jupyter-nobody"}, None, ["notebook_pod='jupyter-nobody': no such pod"]),
    ],
)
def test_bad_settings_are_refused_before_any_pod_starts(kube, monkeypatch, options, arrange, says):
    monkeypatch.delenv("CMLCLUSTER_KUBERNETES_CONTROLLER_IP", raising=False)
    monkeypatch.delenv("CMLCLUSTER_KUBERNETES_IMAGE", raising=False)
    if arrange is not None:
        kube.deny(arrange[1], arrange[2])
    before = len(pods_created(kube))
    try:
        with Session(kube_backend(kube, **options), echo=False) as session, pytest.raises(ConfigError) as refused:
            session.launch_workers(1, cpu=0.5, memory=1)
    finally:
        if arrange is not None:
            kube.allow(arrange[1], arrange[2])
    for words in says:
        assert words in str(refused.value)
    assert len(pods_created(kube)) == before


def test_what_only_cleanup_lists_is_not_asked_of_a_session_and_cleanup_names_it(kube):
    kube.deny("list", "secrets")
    kube.deny("list", "networkpolicies")
    try:
        with Session(kube_backend(kube), echo=False) as session:  # a session never lists them
            [worker] = session.launch_workers(1, cpu=0.5, memory=1, code="print('ok')")
            [done] = session.await_workers([worker], timeout_seconds=60)["workers"]
            assert done["status"] == "succeeded"
        with pytest.raises(ConfigError, match=r"kubectl auth can-i list secrets -n default"):
            delete_orphans(kube_backend(kube))
    finally:
        kube.allow("list", "secrets")
        kube.allow("list", "networkpolicies")


def test_gpus_on_a_cluster_that_advertises_none_are_refused(kube_session, kube):
    before = len(pods_created(kube))
    with pytest.raises(ConfigError, match=r"no node of this cluster advertises nvidia.com/gpu"):
        kube_session.launch_workers(1, cpu=0.5, memory=1, nvidia_gpu=1)
    assert len(pods_created(kube)) == before


def test_gpus_are_requested_as_nvidia_com_gpu(kube, kube_session):
    kube.set_node_gpus(2)
    try:
        (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1, nvidia_gpu=2)
        pod = pod_of(kube, worker["id"])
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        kube_session.stop_workers()
    finally:
        kube.set_node_gpus(0)


def test_a_session_that_dies_leaves_its_pods_to_the_garbage_collector(kube):
    backend = kube_backend(kube)
    session = Session(backend, echo=False)
    workers = session.launch_workers(2, cpu=0.5, memory=1)
    session.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
    secret = names.secret_name(session.id)
    # The notebook's kernel is gone; its Secret's owner (the notebook's pod) goes with it. Here:
    # the Secret is deleted, and the API's garbage collector removes the pods it owns.
    kube.delete_secret(secret)
    wait_until(lambda: not kube.pods(), timeout=30, what="the garbage collector to remove the pods")
    wait_until(
        lambda: [w["status"] for w in session.list_workers()] == ["failed"] * 2, timeout=30, what="the workers to fail"
    )
    assert all("deleted by someone else" in w["message"] for w in session.list_workers())
    session.close()
    assert not kube.containers()


KILLED_SESSION = """
import sys, time
from kubernetes.client import Configuration
from cmlcluster import Session
from cmlcluster.backends.kubernetes.backend import KubernetesBackend

configuration = Configuration(host={url!r})
backend = KubernetesBackend(
    image={image!r}, namespace="default", controller_ip={gateway!r}, configuration=configuration, python=sys.executable
)
session = Session(backend, echo=False)
workers = session.launch_workers(2, cpu=0.5, memory=1)
session.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
print("running", flush=True)
time.sleep(600)
"""


def test_cleanup_ends_what_a_killed_session_left_on_the_cluster(kube):
    code = KILLED_SESSION.format(url=kube.url, image=DOCKER_TEST_IMAGE, gateway=kube.gateway)
    session = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert session.stdout.readline().strip() == "running"
    finally:
        session.kill()  # kill -9: nothing of the session's own teardown runs
        session.wait()
    assert len(kube.pods()) == 2
    backend = kube_backend(kube)
    # Until the session's controller has followed it (its lifeline ends it), cleanup leaves all of it alone.
    would = wait_until(lambda: delete_orphans(backend, dry_run=True), timeout=30, what="the controller to end")
    # Two pods, the NetworkPolicy and the Secret; a dry run ends nothing.
    assert len(would) == 4 and len(kube.pods()) == 2 and len(kube.network_policies()) == 1
    assert sorted(delete_orphans(backend)) == sorted(would)
    wait_until(lambda: not kube.pods() and not kube.containers(), timeout=30, what="the pods to go")
    assert not [s for s in kube.secrets() if s["metadata"]["name"].startswith("cmlcluster-")]
    assert not kube.network_policies()
    assert delete_orphans(backend) == []


def notebook_pod(name: str, labels: dict[str, str]) -> dict:
    """The notebook's own pod, as JupyterHub or a Deployment would run it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            # The stand-in's namespace enforces Pod Security "restricted", as a hardened cluster's would.
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "notebook",
                    "image": DOCKER_TEST_IMAGE,
                    "command": [sys.executable, "-c", "import time; time.sleep(600)"],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


def test_workers_go_with_the_notebook_pod_that_owns_the_session(kube):
    labels = {"app": "jupyterhub", "hub.jupyter.org/username": "alice"}
    core = CoreV1Api(ApiClient(kube.configuration()))
    created = core.create_namespaced_pod("default", notebook_pod("jupyter-alice", labels))
    with Session(kube_backend(kube, notebook_pod="jupyter-alice"), echo=False) as session:
        workers = session.launch_workers(2, cpu=0.5, memory=1)
        session.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
        secret = next(s for s in kube.secrets() if s["metadata"]["name"] == names.secret_name(session.id))
        assert [(o["kind"], o["name"], o["uid"]) for o in secret["metadata"]["ownerReferences"]] == [
            ("Pod", "jupyter-alice", created.metadata.uid)
        ]
        # The session's NetworkPolicy lets the notebook's pod in by a label it alone has (a plugin may
        # not match its IP): its uid, which the session put on it.
        pods = {p["metadata"]["name"]: p for p in kube.pods()}
        assert pods["jupyter-alice"]["metadata"]["labels"] == {**labels, names.POD_UID_LABEL: created.metadata.uid}
        worker_pod = pods[names.pod_name(workers[0]["id"])]
        assert kube.connection_allowed(worker_pod, source_pod=pods["jupyter-alice"])
        assert kube.connection_allowed(worker_pod, source_pod={**pods["jupyter-alice"], "status": {}})
        # Not another replica with the same labels (a Deployment's), nor a colleague's notebook.
        replica = {"metadata": {"namespace": "default", "labels": labels}, "status": {"podIP": "10.250.0.250"}}
        assert not kube.connection_allowed(worker_pod, source_pod=replica)
        bob = {"metadata": {"namespace": "default", "labels": {"app": "jupyterhub", "hub.jupyter.org/username": "bob"}}}
        assert not kube.connection_allowed(worker_pod, source_pod=bob)
        # The notebook's pod goes (its kernel with it): the garbage collector takes the Secret, then the workers.
        kube.delete_pod("jupyter-alice", grace_period_seconds=0)
        wait_until(lambda: not kube.pods(), timeout=30, what="the workers to go with the notebook's pod")
        wait_until(lambda: [w["status"] for w in session.list_workers()] == ["failed"] * 2, timeout=30, what="failures")
    assert not [s for s in kube.secrets() if s["metadata"]["name"].startswith("cmlcluster-")]


def test_a_notebook_pod_that_may_not_be_labelled_is_admitted_by_its_address_with_a_warning(kube, caplog):
    labels = {"app": "notebook", "pod-template-hash": "5d8f7c9b4"}
    core = CoreV1Api(ApiClient(kube.configuration()))
    core.create_namespaced_pod("default", notebook_pod("notebook-5d8f7c9b4-x2x9z", labels))
    # Running, with its address, as a notebook's pod is when its kernel starts a session (on a busy
    # machine the stand-in's kubelet takes a while to start it).
    wait_until(
        lambda: core.read_namespaced_pod("notebook-5d8f7c9b4-x2x9z", "default").status.pod_ip,
        timeout=60,
        what="the notebook's pod to have its address",
    )
    kube.deny("patch", "pods")
    try:
        with Session(kube_backend(kube, notebook_pod="notebook-5d8f7c9b4-x2x9z"), echo=False) as session:
            (worker,) = session.launch_workers(1, cpu=0.5, memory=1)
            session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
            pods = {p["metadata"]["name"]: p for p in kube.pods()}
            notebook, worker_pod = pods["notebook-5d8f7c9b4-x2x9z"], pods[names.pod_name(worker["id"])]
            assert notebook["metadata"]["labels"] == labels
            assert kube.connection_allowed(worker_pod, source_pod=notebook)  # by its address
            replica = {"metadata": {"namespace": "default", "labels": labels}, "status": {"podIP": "10.250.0.250"}}
            assert not kube.connection_allowed(worker_pod, source_pod=replica)
            session.stop_workers()
    finally:
        kube.allow("patch", "pods")
        kube.delete_pod("notebook-5d8f7c9b4-x2x9z", grace_period_seconds=0)
    said = [r.getMessage() for r in caplog.records if "has no label of its own" in r.getMessage()]
    assert len(said) == 1 and "'notebook-5d8f7c9b4-x2x9z'" in said[0], said
    wait_until(lambda: not kube.pods(), timeout=30, what="the pods to go")


def test_a_pod_deleted_while_the_watch_is_down_is_noticed_by_the_next_list(kube, kube_session):
    (worker,) = kube_session.launch_workers(1, cpu=0.5, memory=1)
    kube_session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
    kube.deny("watch", "pods")  # the watch cannot come back...
    try:
        kube.drop_watches()
        kube.delete_pod(names.pod_name(worker["id"]), grace_period_seconds=0)  # ...while the pod goes,
        kube.compact()  # and its deletion leaves no history: the resumed watch gets 410, then a list
    finally:
        kube.allow("watch", "pods")
    failure = failure_of(kube_session, worker)
    assert "is gone (deleted while the watch of the session's pods was down)" in failure["message"]


def test_a_pod_placed_after_waiting_for_nodes_runs(kube):
    kube.set_node_gpus(1)
    try:
        with Session(kube_backend(kube, wait_for_nodes=60), echo=False) as session:
            (first,) = session.launch_workers(1, cpu=0.5, memory=1, nvidia_gpu=1)
            session.await_workers([first], wait_for_completion=False, timeout_seconds=90)
            (second,) = session.launch_workers(1, cpu=0.5, memory=1, nvidia_gpu=1)
            # One GPU on the node: the second waits, Unschedulable, until the first gives it back.
            wait_until(
                lambda: "Unschedulable" in str(pod_of(kube, second["id"])["status"]),
                timeout=30,
                what="the second pod to be unschedulable",
            )
            session.stop_workers(first["id"])
            running = session.await_workers([second], wait_for_completion=False, timeout_seconds=90)
            assert running["failures"] == [] and running["workers"][0]["status"] == "running"
    finally:
        kube.set_node_gpus(0)
