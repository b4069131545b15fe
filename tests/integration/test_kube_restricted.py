"""Least privilege on Kubernetes (issue 23): the stand-in cluster enforces Pod Security "restricted"
as a namespace labelled pod-security.kubernetes.io/enforce=restricted does, and runs pods as a random
non-root uid as OpenShift's restricted SCC does; cmlcluster's pods pass, run that way, read their
Secret and write their folder; each session has a NetworkPolicy that admits to its pods only its own
pods and the notebook, which the stand-in enforces with iptables on its pods' bridge, and that goes
with the session.

What this does not test: a real network plugin (Calico, Cilium: how each matches ipBlocks to pod
addresses differs), policies' ports, and an emptyDir's sizeLimit being enforced (a kubelet evicts;
the stand-in does not).
"""

from __future__ import annotations

import copy
import json
import sys
import urllib.error
import urllib.request

import docker
import ipyparallel as ipp
import pytest
from harness.docker_window import refused_unless_in_dockers_window
from harness.fixtures import DOCKER_TEST_IMAGE, kube_backend
from harness.processes import wait_until
from kubernetes.client import ApiClient, CoreV1Api, NetworkingV1Api
from kubernetes.client.exceptions import ApiException
from kubestandin import RANDOM_UIDS

from cmlcluster import Session
from cmlcluster.backends.kubernetes import names
from cmlcluster.errors import ConfigError

pytestmark = pytest.mark.integration


def core(kube):
    return CoreV1Api(ApiClient(kube.configuration()))


def networking(kube):
    return NetworkingV1Api(ApiClient(kube.configuration()))


def compliant_pod(name):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"test": name}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "worker",
                    "image": DOCKER_TEST_IMAGE,
                    "command": ["sleep", "60"],
                    "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}},
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


def changed(pod, change):
    pod = copy.deepcopy(pod)
    change(pod["spec"], pod["spec"]["containers"][0])
    return pod


def no_escalation_said(spec, c):
    del c["securityContext"]["allowPrivilegeEscalation"]


def non_root_not_asked(spec, c):
    del spec["securityContext"]["runAsNonRoot"]


def capabilities_kept(spec, c):
    del c["securityContext"]["capabilities"]


def a_capability_added(spec, c):
    c["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]


def no_seccomp(spec, c):
    del spec["securityContext"]["seccompProfile"]


def seccomp_unconfined(spec, c):
    c["securityContext"]["seccompProfile"] = {"type": "Unconfined"}


def privileged(spec, c):
    c["securityContext"]["privileged"] = True


def host_network(spec, c):
    spec["hostNetwork"] = True
    spec["hostPID"] = True


def host_path(spec, c):
    spec["volumes"] = [{"name": "host", "hostPath": {"path": "/"}}]
    c["volumeMounts"] = [{"name": "host", "mountPath": "/host"}]


def as_root(spec, c):
    spec["securityContext"]["runAsUser"] = 0


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            no_escalation_said,
            'allowPrivilegeEscalation != false (container "worker" must set '
            "securityContext.allowPrivilegeEscalation=false)",
        ),
        (
            non_root_not_asked,
            'runAsNonRoot != true (pod or container "worker" must set securityContext.runAsNonRoot=true)',
        ),
        (
            capabilities_kept,
            'unrestricted capabilities (container "worker" must set securityContext.capabilities.drop=["ALL"])',
        ),
        (
            a_capability_added,
            'unrestricted capabilities (container "worker" must not include "SYS_ADMIN" in '
            "securityContext.capabilities.add)",
        ),
        (no_seccomp, 'seccompProfile (pod or container "worker" must set securityContext.seccompProfile.type'),
        (
            seccomp_unconfined,
            'seccompProfile (container "worker" must not set securityContext.seccompProfile.type to "Unconfined")',
        ),
        (privileged, 'privileged (container "worker" must not set securityContext.privileged=true)'),
        (host_network, "host namespaces (hostNetwork=true, hostPID=true)"),
        (host_path, 'hostPath volumes (volume "host")'),
        (as_root, "runAsUser=0"),
    ],
)
def test_a_pod_that_breaks_restricted_is_refused_naming_the_rule(kube, change, says):
    name = f"breaks-{change.__name__.replace('_', '-')}"
    with pytest.raises(ApiException) as refused:
        core(kube).create_namespaced_pod("default", changed(compliant_pod(name), change))
    status = json.loads(refused.value.body)
    assert refused.value.status == 403 and status["reason"] == "Forbidden", status
    prefix = f'pods "{name}" is forbidden: violates PodSecurity "restricted:latest": '
    assert status["message"].startswith(prefix) and says in status["message"], status["message"]
    assert not [p for p in kube.pods() if p["metadata"]["name"] == name]


def test_restricted_admits_a_compliant_pod_and_net_bind_service_and_only_where_enforced(kube):
    api = core(kube)
    binding = changed(
        compliant_pod("binds"), lambda s, c: c["securityContext"]["capabilities"].update(add=["NET_BIND_SERVICE"])
    )
    for pod in (compliant_pod("complies"), binding):
        api.create_namespaced_pod("default", pod)
        api.delete_namespaced_pod(pod["metadata"]["name"], "default", grace_period_seconds=0)
    assert api.read_namespace("default").metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    kube.set_pod_security("privileged")  # a namespace that enforces nothing admits what restricted refuses
    try:
        api.create_namespaced_pod("default", changed(compliant_pod("loose"), no_escalation_said))
        api.delete_namespaced_pod("loose", "default", grace_period_seconds=0)
    finally:
        kube.set_pod_security("restricted")
    wait_until(lambda: not kube.pods(), timeout=30, what="the test pods to go")


# ---------------------------------------------------------------- cmlcluster's pods


def in_worker():
    """What a worker sees of itself: uid, groups, the Secret's file, and whether it may write its folder."""
    import os
    import stat

    path = "/var/run/cmlcluster/connection.json"  # the agent read it, and took its variable away
    with open(path) as f:
        readable = bool(f.read())
    with open("written-by-the-worker", "w") as f:
        f.write("ok")
    info = os.stat(path)
    return os.getuid(), os.getgid(), sorted(os.getgroups()), readable, stat.S_IMODE(info.st_mode), info.st_gid


def test_cmlcluster_pods_pass_restricted_and_run_as_a_random_non_root_uid(kube):
    with Session(kube_backend(kube), echo=False) as session:
        workers = session.launch_workers(2, cpu=0.5, memory=1)
        running = session.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
        assert running["failures"] == []
        seen = session.client[:].apply_sync(ipp.interactive(in_worker))
        pods = [p for p in kube.pods() if p["metadata"]["labels"].get(names.SESSION_LABEL) == session.id]
    uids = [uid for uid, *_ in seen]
    assert all(uid in RANDOM_UIDS for uid in uids) and len(set(uids)) == 2, seen  # one per pod, never root
    for _, gid, groups, readable, mode, owner in seen:
        # The cluster's random uid is in group 0 and the pod's fsGroup, which owns the Secret's files.
        assert gid == 0 and 1000 in groups and readable and (mode, owner) == (0o440, 1000)
    for pod in pods:
        assert "runAsUser" not in pod["spec"]["securityContext"]  # left to the cluster
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["requests"]["ephemeral-storage"] == "10Gi"
        work = next(v for v in pod["spec"]["volumes"] if "emptyDir" in v)
        assert work["emptyDir"] == {"sizeLimit": "10Gi"}


def test_run_as_user_and_fs_group_options_are_what_the_pods_run_as(kube):
    with Session(kube_backend(kube, run_as_user=4321, fs_group=4322), echo=False) as session:
        (worker,) = session.launch_workers(1, cpu=0.5, memory=1)
        session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
        ((uid, _, groups, readable, mode, owner),) = session.client[:].apply_sync(ipp.interactive(in_worker))
    assert (uid, readable, mode, owner) == (4321, True, 0o440, 4322) and 4322 in groups


# ---------------------------------------------------------------- the session's NetworkPolicy


def test_the_session_network_policy_admits_only_its_pods_and_the_notebook_and_goes_with_it(kube):
    with Session(kube_backend(kube), echo=False) as mine, Session(kube_backend(kube), echo=False) as other:
        workers = mine.launch_workers(2, cpu=0.5, memory=1)
        (stranger,) = other.launch_workers(1, cpu=0.5, memory=1)
        mine.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
        other.await_workers([stranger], wait_for_completion=False, timeout_seconds=90)
        policies = {p["metadata"]["labels"][names.SESSION_LABEL]: p for p in kube.network_policies()}
        assert set(policies) == {mine.id, other.id}
        policy = policies[mine.id]
        assert policy["metadata"]["ownerReferences"][0]["name"] == names.secret_name(mine.id)
        pods = {p["metadata"]["name"]: p for p in kube.pods()}
        a, b = (pods[names.pod_name(w["id"])] for w in workers)
        outsider = pods[names.pod_name(stranger["id"])]
        assert kube.connection_allowed(a, source_pod=b) and kube.connection_allowed(b, source_pod=a)
        assert kube.connection_allowed(a, source_ip=kube.gateway)  # the notebook: the controller's address
        assert not kube.connection_allowed(a, source_pod=outsider)  # another session's pod
        assert not kube.connection_allowed(outsider, source_pod=a)  # and the other way round
        assert not kube.connection_allowed(a, source_ip="192.0.2.7")
    wait_until(lambda: not kube.network_policies(), timeout=30, what="the sessions' policies to go")


def listen_once_more():
    """In a worker: accept connections on port 9999 (a server a framework would start), on a thread."""
    import socket
    import threading

    server = socket.create_server(("0.0.0.0", 9999))  # all interfaces, as TensorFlow binds

    def serve():
        while True:
            connection, _ = server.accept()
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return True


CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9999), timeout=3).close()
    print("connected")
except OSError as e:
    print("not connected:", e)
"""


def connects(kube, pod_from, ip_to):
    (container,) = [c for c in kube.containers() if c.labels["cmlcluster-standin.pod"] == f"default/{pod_from}"]
    return container.exec_run([sys.executable, "-c", CONNECT, ip_to]).output.decode().strip() == "connected"


def connects_across_sessions(kube, pod_from, ip_to):
    """connects(), for a connection the policy refuses: tried again when Docker's own window (its firewall's
    jumps gone while it creates a network: docker_window.py) explains that it got through."""
    engine = docker.from_env(timeout=30)
    try:
        return refused_unless_in_dockers_window(engine, lambda: connects(kube, pod_from, ip_to), bool)
    finally:
        engine.close()


def test_the_stand_in_enforces_the_session_network_policy_on_its_pods_network(kube):
    if not kube.enforcing:
        pytest.skip(f"NetworkPolicies are not enforced here: {kube.not_enforcing}")
    with Session(kube_backend(kube), echo=False) as mine, Session(kube_backend(kube), echo=False) as other:
        workers = mine.launch_workers(2, cpu=0.5, memory=1)
        (stranger,) = other.launch_workers(1, cpu=0.5, memory=1)
        mine.await_workers(workers, wait_for_completion=False, timeout_seconds=90)
        other.await_workers([stranger], wait_for_completion=False, timeout_seconds=90)
        assert mine.client[:].apply_sync(ipp.interactive(listen_once_more)) == [True, True]
        assert other.client[:].apply_sync(ipp.interactive(listen_once_more)) == [True]
        kube.wait_for_network_rules()
        a, b = (names.pod_name(w["id"]) for w in workers)
        ip = {w["id"]: w["ip_address"] for w in mine.list_workers() + other.list_workers()}
        outsider = names.pod_name(stranger["id"])
        assert connects(kube, b, ip[workers[0]["id"]])  # the session's own pods reach each other
        assert not connects_across_sessions(kube, outsider, ip[workers[0]["id"]])  # another session's pod does not
        assert not connects_across_sessions(kube, a, ip[stranger["id"]])  # nor the other way round
        assert connects(kube, outsider, ip[stranger["id"]])  # (itself: its own address, never bridged)
    kube.wait_for_network_rules()


def test_network_policy_false_makes_none_and_rbac_for_policies_is_checked_first(kube):
    with Session(kube_backend(kube, network_policy=False), echo=False) as session:
        (worker,) = session.launch_workers(1, cpu=0.5, memory=1)
        session.await_workers([worker], wait_for_completion=False, timeout_seconds=90)
        assert kube.network_policies() == []
    kube.deny("create", "networkpolicies")
    try:
        with Session(kube_backend(kube), echo=False) as session, pytest.raises(ConfigError) as refused:
            session.launch_workers(1, cpu=0.5, memory=1)
    finally:
        kube.allow("create", "networkpolicies")
    assert "may not create networkpolicies.networking.k8s.io" in str(refused.value)
    assert "network_policy=False" in str(refused.value)


def test_the_stand_in_validates_stores_lists_and_collects_network_policies(kube):
    api, secrets = networking(kube), core(kube)
    owner = secrets.create_namespaced_secret("default", {"metadata": {"name": "np-owner"}, "data": {}})
    ref = {"apiVersion": "v1", "kind": "Secret", "name": "np-owner", "uid": owner.metadata.uid}
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np", "labels": {"t": "np"}, "ownerReferences": [ref]},
        "spec": {"podSelector": {"matchLabels": {"app": "x"}}, "ingress": [{"from": [{"podSelector": {}}]}]},
    }
    wrong = copy.deepcopy(policy)
    wrong["spec"]["ingress"] = {"from": []}  # a list in the schema; sent raw, as the client checks types itself
    url = f"{kube.url}/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"
    request = urllib.request.Request(url, json.dumps(wrong).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as invalid:
        urllib.request.urlopen(request, timeout=10)
    status = json.load(invalid.value)
    assert invalid.value.code == 422 and status["reason"] == "Invalid" and "spec.ingress" in status["message"]
    created = api.create_namespaced_network_policy("default", policy)
    assert created.metadata.uid and created.spec.pod_selector.match_labels == {"app": "x"}
    listed = api.list_namespaced_network_policy("default", label_selector="t=np")
    assert [p.metadata.name for p in listed.items] == ["np"]
    assert api.read_namespaced_network_policy("np", "default").metadata.uid == created.metadata.uid
    secrets.delete_namespaced_secret("np-owner", "default")  # the garbage collector takes what it owns
    wait_until(lambda: not api.list_namespaced_network_policy("default").items, timeout=30, what="collection")
    with pytest.raises(ApiException) as gone:
        api.delete_namespaced_network_policy("np", "default")
    assert gone.value.status == 404
