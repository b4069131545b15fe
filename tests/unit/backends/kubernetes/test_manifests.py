"""The Kubernetes backend's Pod and Secret manifests: valid for the API, and right field by field.

Every manifest is validated in strict mode (unknown fields fail) against the OpenAPI schemas of
named Kubernetes versions by kubernetes-validate; no API server is needed.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re

import kubernetes_validate  # the dev extra's; no skip when missing: these tests must run
import pytest
from kubernetes.utils.quantity import parse_quantity

from cmlcluster.backends.base import SessionContext
from cmlcluster.backends.docker.backend import DockerBackend
from cmlcluster.backends.kubernetes import manifests as m
from cmlcluster.backends.kubernetes import names as n
from cmlcluster.backends.kubernetes import options as o
from cmlcluster.errors import ConfigError
from cmlcluster.workers import Resources, WorkerSpec

# The oldest the `kubernetes>=29` client speaks to, a middle one, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29.0", "1.31.0", "1.37.0")

SESSION = "a1b2c3"
NAMESPACE = "ml-team"
IMAGE = "registry.example.com/cmlcluster-worker:1.0"
SECRET_UID = "9f1c7a52-3b1e-4c55-8a51-0c5c7c1e2f10"
NOTEBOOK_POD = {"name": "jupyter-alice", "uid": "0d3d5c1e-6a6f-4f0e-9d8e-2f1b8b1c4a77"}
CONNECTION = json.dumps({"key": "controller-key-d41d8cd98f", "registration": 40123, "interface": "tcp://10.1.2.3"})

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def make_spec(cpu: float = 2, memory: float = 4, nvidia_gpu: int = 0, engine_id: int = 0, **kwargs) -> WorkerSpec:
    """A spec as worker_env.build_spec makes it: the user's env plus cmlcluster's, the connection included."""
    worker_id = kwargs.pop("worker_id", f"{SESSION}-{engine_id}")
    env = {
        "MY_SETTING": "user value",
        "CMLCLUSTER_CONNECTION": CONNECTION,
        "CDSW_MASTER_IP": "10.1.2.3",
        "CML_MASTER_IP": "10.1.2.3",
        "CDSW_MASTER_ID": SESSION,
        "CDSW_ENGINE_ID": worker_id,
        "CMLCLUSTER_ENGINE_ID": str(engine_id),
        "PYTHONUNBUFFERED": "1",
        **kwargs.pop("env", {}),
    }
    return WorkerSpec(
        worker_id=worker_id,
        engine_id=engine_id,
        argv=("python3", "-m", "cmlcluster.agent"),
        env=env,
        resources=Resources(cpu=cpu, memory=memory, nvidia_gpu=nvidia_gpu),
        cwd=kwargs.pop("cwd", "/home/alice/project"),
    )


def make_pod(spec: WorkerSpec | None = None, options: o.PodOptions | None = None) -> dict:
    return m.worker_pod(
        spec or make_spec(),
        session_id=SESSION,
        namespace=NAMESPACE,
        image=IMAGE,
        secret_name=n.secret_name(SESSION),
        secret_uid=SECRET_UID,
        options=options,
    )


FULL_OPTIONS = o.PodOptions(
    node_selector={"nvidia.com/gpu.present": "true", "pool": "training"},
    tolerations=[
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
        {"key": "team", "operator": "Equal", "value": "ml", "effect": "PreferNoSchedule"},
    ],
    service_account="cmlcluster-worker",
    image_pull_secrets=["regcred", "mirror.example.com"],
    env={"NCCL_DEBUG": "INFO", "MY_SETTING": "backend default"},
    shared_volume=o.SharedVolume(claim="team-efs", mount_path="/shared"),
)


def container(pod: dict) -> dict:
    (only,) = pod["spec"]["containers"]
    return only


def env_of(pod: dict, secret_data: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's variables as the kubelet sets them: a reference is looked up in secret_data
    (the Secret's data, base64), or shown as "secret:<key>" without it."""
    pairs = container(pod)["env"]
    assert all(set(pair) in ({"name", "value"}, {"name", "valueFrom"}) for pair in pairs), pairs
    names = [pair["name"] for pair in pairs]
    assert len(names) == len(set(names)), f"a variable set twice: {names}"
    env = {}
    for pair in pairs:
        if "value" in pair:
            env[pair["name"]] = pair["value"]
            continue
        ref = pair["valueFrom"]["secretKeyRef"]
        assert ref["name"] == n.secret_name(SESSION) and "optional" not in ref
        key = ref["key"]
        env[pair["name"]] = base64.b64decode(secret_data[key]).decode() if secret_data else f"secret:{key}"
    return env


def assert_valid(manifest: dict) -> None:
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{manifest['kind']} is not valid for Kubernetes {version} at {path}: {e.message}")


# ---------------------------------------------------------------- the validator itself


def test_the_validator_is_strict_so_a_pass_means_something():
    # Without strict mode an unknown (misspelt) field passes; these must fail, or the rest proves nothing.
    pod = make_pod()
    misspelt = {**pod, "spec": {**pod["spec"], "restartpolicy": "Never"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="restartpolicy"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[0], strict=True)
    wrong_type = json.loads(json.dumps(pod))
    wrong_type["spec"]["volumes"][0]["secret"]["defaultMode"] = "0400"
    with pytest.raises(kubernetes_validate.ValidationError, match="0400"):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSIONS[0], strict=True)


# ---------------------------------------------------------------- the session Secret


def test_session_secret_carries_the_connection_owned_by_the_notebook_pod():
    secret = m.session_secret(SESSION, namespace=NAMESPACE, connection_info=CONNECTION, owner=NOTEBOOK_POD)
    assert_valid(secret)
    assert (secret["apiVersion"], secret["kind"], secret["type"]) == ("v1", "Secret", "Opaque")
    metadata = secret["metadata"]
    assert metadata["name"] == f"cmlcluster-{SESSION}" == n.secret_name(SESSION)
    assert metadata["namespace"] == NAMESPACE
    assert metadata["labels"] == {
        "cmlcluster.io/session": SESSION,
        "app.kubernetes.io/managed-by": "cmlcluster",
        "app.kubernetes.io/component": "session",
    }
    assert metadata["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "jupyter-alice",
            "uid": NOTEBOOK_POD["uid"],
            "controller": False,
            "blockOwnerDeletion": False,
        }
    ]
    assert "stringData" not in secret
    decoded = {key: base64.b64decode(value, validate=True).decode() for key, value in secret["data"].items()}
    assert decoded == {"connection.json": CONNECTION}  # no SSH key: no worker needs the private one
    assert m.CONNECTION_FILE == f"{n.SESSION_MOUNT_PATH}/connection.json"


def test_session_secret_outside_a_cluster_has_no_owner():
    secret = m.session_secret(SESSION, namespace=NAMESPACE, connection_info=CONNECTION)
    assert_valid(secret)
    assert "ownerReferences" not in secret["metadata"] and "annotations" not in secret["metadata"]
    assert list(secret["data"]) == [m.CONNECTION_KEY]


def test_session_secret_says_where_the_session_runs_for_cleanup():
    secret = m.session_secret(SESSION, namespace=NAMESPACE, connection_info=CONNECTION, origin=("laptop-7", 4242))
    assert_valid(secret)
    assert secret["metadata"]["annotations"] == {"cmlcluster.io/host": "laptop-7", "cmlcluster.io/pid": "4242"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(owner={"name": "jupyter-alice"}), r"owner=\{'name': 'jupyter-alice'\}.*'uid'"),
        (dict(owner={"uid": "0d3d"}), r"owner=\{'uid': '0d3d'\}.*'name'"),
        (dict(connection_info=""), "connection_info"),
    ],
)
def test_session_secret_refuses_incomplete_input(kwargs, message):
    args = dict(namespace=NAMESPACE, connection_info=CONNECTION) | kwargs
    with pytest.raises(ConfigError, match=message):
        m.session_secret(SESSION, **args)


# ---------------------------------------------------------------- the worker Pod


@pytest.mark.parametrize("options", [None, FULL_OPTIONS], ids=["defaults", "all-options"])
@pytest.mark.parametrize("nvidia_gpu", [0, 2])
def test_worker_pod_is_valid(options, nvidia_gpu):
    assert_valid(make_pod(make_spec(nvidia_gpu=nvidia_gpu, cwd="/shared/project"), options))


def test_worker_pod_runs_the_agent_once_owned_by_the_session_secret():
    spec = make_spec(engine_id=3)
    pod = make_pod(spec)
    assert (pod["apiVersion"], pod["kind"]) == ("v1", "Pod")
    assert pod["metadata"]["name"] == f"cmlcluster-{SESSION}-3"
    assert pod["metadata"]["namespace"] == NAMESPACE
    assert pod["spec"]["restartPolicy"] == "Never"
    assert container(pod)["image"] == IMAGE
    assert container(pod)["command"] == ["python3", "-m", "cmlcluster.agent"] == list(spec.argv)
    assert "args" not in container(pod)
    assert pod["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "name": f"cmlcluster-{SESSION}",
            "uid": SECRET_UID,
            "controller": True,
            "blockOwnerDeletion": False,
        }
    ]
    # Like docker's --init: the agent is not PID 1.
    assert pod["spec"]["shareProcessNamespace"] is True
    assert pod["spec"]["enableServiceLinks"] is False


def test_worker_labels_mark_session_and_worker():
    pod = make_pod(make_spec(engine_id=7))
    labels = pod["metadata"]["labels"]
    assert labels == {
        "cmlcluster.io/session": SESSION,
        "cmlcluster.io/worker": f"{SESSION}-7",
        "app.kubernetes.io/managed-by": "cmlcluster",
        "app.kubernetes.io/component": "worker",
    }
    # The session's selector finds the worker (and the Secret).
    for term in n.session_selector(SESSION).split(","):
        key, value = term.split("=")
        assert labels[key] == value


@pytest.mark.parametrize(
    "cpu, memory, cpu_quantity, memory_quantity",
    [
        (2, 4, "2", "4Gi"),
        (0.5, 1.5, "500m", "1536Mi"),
        (0.7, 0.25, "700m", "256Mi"),
        (4.03, 2.5, "4030m", "2560Mi"),  # 4.03 * 1000 is 4030.0000000000005 in floating point
        (1.0001, 1.1, "1001m", "1126Mi"),  # Kubernetes rounds CPU up to whole millicores
        (16, 64, "16", "64Gi"),
    ],
)
def test_worker_resources_are_requests_and_limits(cpu, memory, cpu_quantity, memory_quantity):
    pod = make_pod(make_spec(cpu=cpu, memory=memory))
    resources = container(pod)["resources"]
    expected = {"cpu": cpu_quantity, "memory": memory_quantity}
    # Local disk is requested (for the scheduler) and not limited: the working folder's sizeLimit is.
    assert resources == {"requests": {**expected, "ephemeral-storage": "10Gi"}, "limits": expected}
    # The quantities mean what cmlcluster means: GB are GiB, the same whole MiB docker's mem_limit gives.
    mib = int(memory * 1024)
    assert parse_quantity(resources["limits"]["memory"]) == mib * 2**20
    docker = DockerBackend(image=IMAGE, mount_cwd=False, gpu_ids=[])
    docker.context = SessionContext(session_id=SESSION, session_dir="/nonexistent")
    assert docker.container_options(make_spec(cpu=cpu, memory=memory), [])["mem_limit"] == f"{mib}m"
    assert parse_quantity(resources["limits"]["cpu"]) >= parse_quantity(str(cpu))


def test_gpus_are_requested_only_when_asked_for():
    with_gpus = container(make_pod(make_spec(nvidia_gpu=2)))["resources"]
    assert with_gpus["limits"]["nvidia.com/gpu"] == "2"
    assert with_gpus["requests"]["nvidia.com/gpu"] == "2"  # extended resources: requests must equal limits
    # A parameter server's Resources carry nvidia_gpu=0 (decided upstream): no GPU key at all.
    parameter_server = container(make_pod(make_spec(nvidia_gpu=0)))["resources"]
    assert "nvidia.com/gpu" not in parameter_server["limits"]
    assert "nvidia.com/gpu" not in parameter_server["requests"]
    assert set(parameter_server["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize(
    "resources, message",
    [
        (Resources(cpu=0, memory=1), "cpu=0"),
        (Resources(cpu=1, memory=0.0001), r"memory=0.0001: less than 1 MiB"),
        (Resources(cpu=1, memory=float("inf")), "memory=inf"),
        (Resources(cpu=1, memory=1, nvidia_gpu=-1), "nvidia_gpu=-1"),
    ],
)
def test_impossible_resources_are_refused(resources, message):
    spec = dataclasses.replace(make_spec(), resources=resources)
    with pytest.raises(ConfigError, match=message):
        make_pod(spec)


def test_session_secret_is_mounted_read_only_to_owner_and_group_and_the_work_folder_is_bounded():
    pod = make_pod()
    assert pod["spec"]["volumes"] == [
        {"name": "cmlcluster-session", "secret": {"secretName": f"cmlcluster-{SESSION}", "defaultMode": 0o440}},
        {"name": "cmlcluster-work", "emptyDir": {"sizeLimit": "10Gi"}},
    ]
    assert pod["spec"]["volumes"][0]["secret"]["defaultMode"] == 288  # what the API receives
    # The pod's fsGroup owns the Secret's files: a worker under any uid the cluster picks reads them.
    assert pod["spec"]["securityContext"]["fsGroup"] == 1000
    assert container(pod)["volumeMounts"] == [
        {"name": "cmlcluster-session", "mountPath": "/var/run/cmlcluster", "readOnly": True},
        {"name": "cmlcluster-work", "mountPath": "/var/cmlcluster/work"},
    ]
    # The session's folder is not on the worker: it works in a folder of its own, not the image's.
    assert container(pod)["workingDir"] == "/var/cmlcluster/work"


def test_shared_volume_is_mounted_and_is_the_working_folder_when_the_session_works_there():
    pod = make_pod(make_spec(cwd="/shared/alice/project"), FULL_OPTIONS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["cmlcluster-shared"] == {
        "name": "cmlcluster-shared",
        "persistentVolumeClaim": {"claimName": "team-efs"},
    }
    mounts = {mount["mountPath"]: mount for mount in container(pod)["volumeMounts"]}
    assert mounts["/shared"] == {"name": "cmlcluster-shared", "mountPath": "/shared"}  # read-write
    assert mounts["/var/run/cmlcluster"]["readOnly"] is True
    assert container(pod)["workingDir"] == "/shared/alice/project"
    assert "cmlcluster-work" not in volumes
    elsewhere = make_pod(make_spec(cwd="/sharedother/project"), FULL_OPTIONS)
    assert container(elsewhere)["workingDir"] == "/var/cmlcluster/work"


def test_secrets_never_reach_the_environment():
    spec = make_spec()
    assert spec.env["CMLCLUSTER_CONNECTION"] == CONNECTION  # what the session puts in every spec
    pod = make_pod(spec, FULL_OPTIONS)
    env = env_of(pod)
    assert "CMLCLUSTER_CONNECTION" not in env
    assert env["CMLCLUSTER_CONNECTION_FILE"] == "/var/run/cmlcluster/connection.json" == m.CONNECTION_FILE
    assert "controller-key-d41d8cd98f" not in json.dumps(pod)  # nowhere in the pod, not only env
    assert "sessionkey" not in json.dumps(pod)
    assert "CMLCLUSTER_CONNECTION" not in json.dumps(m.env_secret_data(spec, FULL_OPTIONS))  # a file, not a key


def test_env_values_are_in_the_session_secret_and_the_pod_spec_only_names_them():
    marker = "s3cr3t-marker-7f1c9e"
    spec = make_spec(env={"WANDB_API_KEY": marker, "MY_SETTING": "launch value"}, engine_id=3)
    pod = make_pod(spec, FULL_OPTIONS)
    assert marker not in json.dumps(pod)  # not in env, command, annotations: nowhere in the pod
    data = m.env_secret_data(spec, FULL_OPTIONS)
    assert set(data) == {"env.3.WANDB_API_KEY", "env.3.MY_SETTING", "env.3.NCCL_DEBUG"}
    assert base64.b64decode(data["env.3.WANDB_API_KEY"]).decode() == marker
    assert env_of(pod)["WANDB_API_KEY"] == "secret:env.3.WANDB_API_KEY"
    assert env_of(pod, data)["WANDB_API_KEY"] == marker  # what the worker sees
    # cmlcluster's own variables (ids, addresses, paths) stay readable in the pod spec.
    assert env_of(pod)["CDSW_ENGINE_ID"] == spec.worker_id and env_of(pod)["PYTHONUNBUFFERED"] == "1"
    # The Secret with those keys is still a valid Secret, and the pod a valid Pod.
    secret = m.session_secret(SESSION, namespace=NAMESPACE, connection_info=CONNECTION)
    secret["data"].update(data)
    assert_valid(secret)
    assert_valid(pod)


def test_environment_is_the_specs_plus_the_options():
    spec = make_spec(env={"MY_SETTING": "launch value"})
    pod = make_pod(spec, FULL_OPTIONS)
    env = env_of(pod, m.env_secret_data(spec, FULL_OPTIONS))
    expected = {k: v for k, v in spec.env.items() if k != "CMLCLUSTER_CONNECTION"}
    expected |= {"NCCL_DEBUG": "INFO", "CMLCLUSTER_CONNECTION_FILE": m.CONNECTION_FILE}
    assert env == expected
    assert env["MY_SETTING"] == "launch value"  # a launch's own env wins over the backend's default

    def seen(spec, options):
        return env_of(make_pod(spec, options), m.env_secret_data(spec, options))

    assert seen(make_spec(), o.PodOptions(env={"MY_SETTING": "x"}))["MY_SETTING"] == "user value"
    assert seen(make_spec(), o.PodOptions(env={"NEW": "x"}))["NEW"] == "x"


def test_pod_options_reach_the_pod_spec():
    pod_spec = make_pod(options=FULL_OPTIONS)["spec"]
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pool": "training"}
    assert pod_spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
        {"key": "team", "operator": "Equal", "value": "ml", "effect": "PreferNoSchedule"},
    ]
    assert pod_spec["serviceAccountName"] == "cmlcluster-worker"
    assert pod_spec["automountServiceAccountToken"] is True
    assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror.example.com"}]


# ---------------------------------------------------------------- Pod Security "restricted"


def restricted_violations(pod: dict) -> list[str]:
    """The rules of Pod Security "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards)
    that `pod` breaks, as the stand-in cluster's admission checks them."""
    from kubestandin.podsecurity import violations

    return violations(pod)


@pytest.mark.parametrize("options", [None, FULL_OPTIONS, o.PodOptions(fs_group=None, run_as_user=1000680000)])
def test_worker_pods_pass_pod_security_restricted(options):
    pod = make_pod(make_spec(cwd="/shared/project"), options)
    assert restricted_violations(pod) == []
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container(pod)["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    # The check is real: the same pod without one of them is refused, naming the rule.
    loose = json.loads(json.dumps(pod))
    del container(loose)["securityContext"]["allowPrivilegeEscalation"]
    assert [v.split(" (")[0] for v in restricted_violations(loose)] == ["allowPrivilegeEscalation != false"]


def test_run_as_user_is_left_to_the_cluster_unless_given():
    # OpenShift's restricted SCC assigns a uid from the namespace's range, and refuses one outside it.
    assert "runAsUser" not in make_pod()["spec"]["securityContext"]
    given = make_pod(options=o.PodOptions(run_as_user=2000, fs_group=None))["spec"]["securityContext"]
    assert given["runAsUser"] == 2000 and "fsGroup" not in given


def test_working_folder_size_and_local_disk_are_options():
    pod = make_pod(options=o.PodOptions(work_size="2Gi", ephemeral_storage="3Gi"))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["cmlcluster-work"]["emptyDir"] == {"sizeLimit": "2Gi"}
    assert container(pod)["resources"]["requests"]["ephemeral-storage"] == "3Gi"
    assert "ephemeral-storage" not in container(pod)["resources"]["limits"]
    assert_valid(pod)
    # Local disk follows the working folder's size unless given.
    follows = container(make_pod(options=o.PodOptions(work_size="5G")))["resources"]["requests"]
    assert follows["ephemeral-storage"] == "5G"


# ---------------------------------------------------------------- the NetworkPolicy


def make_policy(**kwargs) -> dict:
    settings = dict(
        namespace=NAMESPACE, secret_name=n.secret_name(SESSION), secret_uid=SECRET_UID, notebook_ips=["10.1.2.3"]
    )
    return m.network_policy(SESSION, **(settings | kwargs))


# The notebook's pod as a Deployment runs it: its replicas share every label, pod-template-hash too.
DEPLOYMENT_LABELS = {"app": "jupyter", "user": "alice", "pod-template-hash": "5d8f7c9b4"}


def notebook_pod(name: str, uid: str, ip: str, **labels: str) -> dict:
    meta = {"name": name, "uid": uid, "namespace": NAMESPACE, "labels": {**DEPLOYMENT_LABELS, **labels}}
    return {"metadata": meta, "status": {"podIP": ip}}


def test_network_policy_is_valid_and_owned_by_the_session_secret():
    options = o.PodOptions(allow_from=[{"ipBlock": {"cidr": "192.0.2.0/24"}}])
    selector = {n.POD_UID_LABEL: NOTEBOOK_POD["uid"]}
    for policy in (make_policy(), make_policy(notebook_selector=selector, options=options)):
        assert_valid(policy)
        assert policy["metadata"]["ownerReferences"][0]["uid"] == SECRET_UID
        assert policy["metadata"]["labels"]["cmlcluster.io/session"] == SESSION
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # workers connect out to the controller


def test_network_policy_selects_the_sessions_pods_and_admits_them_and_the_notebook():
    from kubestandin.netpol import admits, selects

    pod = make_pod()
    other_session = make_pod(make_spec(worker_id="ffffff-0"))
    other_session["metadata"]["labels"] = n.worker_labels("ffffff", "ffffff-0")
    uid = NOTEBOOK_POD["uid"]
    notebook = notebook_pod("jupyter-alice-5d8f7c9b4-x2x9z", uid, "10.244.0.7", **{n.POD_UID_LABEL: uid})
    # Another replica of the notebook's Deployment (every label the same but the one cmlcluster adds).
    replica = notebook_pod("jupyter-alice-5d8f7c9b4-q8k2m", "3e0a", "10.244.0.8")
    colleague = {"metadata": {"namespace": NAMESPACE, "labels": {"app": "jupyter", "user": "bob"}}}
    policy = make_policy(notebook_ips=["10.1.2.3", "10.244.0.7"], notebook_selector={n.POD_UID_LABEL: uid})
    namespaces = {NAMESPACE: {"kubernetes.io/metadata.name": NAMESPACE}}
    assert selects(policy, pod) and not selects(policy, other_session)
    assert admits(policy, namespaces, source_pod=pod)
    assert admits(policy, namespaces, source_pod=notebook)
    assert admits(policy, namespaces, source_pod={**notebook, "status": {}})  # by its label alone (Cilium)
    assert admits(policy, namespaces, source_ip="10.1.2.3")
    assert not admits(policy, namespaces, source_pod=replica)
    assert not admits(policy, namespaces, source_pod=other_session)
    assert not admits(policy, namespaces, source_pod=colleague)
    assert not admits(policy, namespaces, source_ip="10.1.2.4")
    # The same labels in another namespace are not the session's pods.
    elsewhere = json.loads(json.dumps(pod))
    elsewhere["metadata"]["namespace"] = "other"
    assert not admits(policy, {**namespaces, "other": {}}, source_pod=elsewhere)


def test_a_notebook_pod_without_labels_never_opens_the_policy_to_every_pod():
    peers = make_policy(notebook_selector={})["spec"]["ingress"][0]["from"]
    session_pods = {**n.session_labels(SESSION), "app.kubernetes.io/component": "worker"}
    assert [peer for peer in peers if "podSelector" in peer] == [{"podSelector": {"matchLabels": session_pods}}]


class FakeCore:
    """The CoreV1Api calls SessionObjects makes, on a namespace holding `pods` (dicts as the API has them)."""

    def __init__(self, pods: list[dict], may_patch_pods: bool = True):
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.may_patch_pods = may_patch_pods
        self.patched: list[tuple[str, dict]] = []

    def read_namespaced_pod(self, name, namespace, **_):
        from kubernetes.client import ApiClient

        return ApiClient()._ApiClient__deserialize(self.pods[name], "V1Pod")

    def patch_namespaced_pod(self, name, namespace, body, **_):
        from kubernetes.client.rest import ApiException

        if not self.may_patch_pods:
            raise ApiException(status=403, reason="Forbidden")
        self.patched.append((name, body))
        self.pods[name]["metadata"]["labels"].update(body["metadata"]["labels"])

    def patch_namespaced_secret(self, name, namespace, body, **_):
        pass  # a worker's env= values

    def create_namespaced_secret(self, namespace, body):
        from types import SimpleNamespace

        return SimpleNamespace(metadata=SimpleNamespace(name=body["metadata"]["name"], uid=SECRET_UID))


class FakeNetworking:
    def __init__(self):
        self.policies: list[dict] = []

    def create_namespaced_network_policy(self, namespace, body):
        self.policies.append(body)


def session_policy(core: FakeCore, notebook: str, session: str = SESSION) -> dict:
    """The NetworkPolicy a session in the notebook pod `notebook` makes with its first worker."""
    from cmlcluster.backends.kubernetes.session_objects import SessionObjects

    networking = FakeNetworking()
    objects = SessionObjects(
        lambda: core, lambda: networking, NAMESPACE, session, o.PodOptions(), notebook, lambda: "10.244.0.7"
    )
    objects.secret(CONNECTION, make_spec())
    (policy,) = networking.policies
    return policy


def admitted(policy: dict, pod: dict) -> bool:
    from kubestandin.netpol import admits

    return admits(policy, {NAMESPACE: {}}, source_pod=pod)


def test_the_notebook_pod_gets_a_label_of_its_own_and_its_replicas_are_not_admitted():
    uid = NOTEBOOK_POD["uid"]
    alice = notebook_pod("jupyter-alice-5d8f7c9b4-x2x9z", uid, "10.244.0.7")
    replica = notebook_pod("jupyter-alice-5d8f7c9b4-q8k2m", "3e0a", "10.244.0.8")
    core = FakeCore([alice, replica])
    policy = session_policy(core, "jupyter-alice-5d8f7c9b4-x2x9z")
    assert core.patched == [("jupyter-alice-5d8f7c9b4-x2x9z", {"metadata": {"labels": {n.POD_UID_LABEL: uid}}})]
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {n.POD_UID_LABEL: uid}}} in peers
    assert {"ipBlock": {"cidr": "10.244.0.7/32"}} in peers
    assert admitted(policy, core.pods["jupyter-alice-5d8f7c9b4-x2x9z"])
    assert admitted(policy, {**core.pods["jupyter-alice-5d8f7c9b4-x2x9z"], "status": {}})  # by its label alone
    assert not admitted(policy, replica) and not admitted(policy, {**replica, "status": {}})
    # A second session in the same pod finds the label there already.
    second = session_policy(core, "jupyter-alice-5d8f7c9b4-x2x9z", "b2c3d4")
    assert second["spec"]["ingress"][0]["from"][1:] == peers[1:]
    assert len(core.patched) == 1


def test_a_statefulset_notebook_pod_is_selected_by_its_own_name_without_a_patch():
    name = "jupyter-alice-0"
    pod = notebook_pod(name, NOTEBOOK_POD["uid"], "10.244.0.7", **{n.STATEFULSET_POD_NAME_LABEL: name})
    sibling = notebook_pod("jupyter-alice-1", "3e0a", "10.244.0.8", **{n.STATEFULSET_POD_NAME_LABEL: "jupyter-alice-1"})
    core = FakeCore([pod, sibling], may_patch_pods=False)
    policy = session_policy(core, name)
    assert core.patched == []
    assert {"podSelector": {"matchLabels": {n.STATEFULSET_POD_NAME_LABEL: name}}} in policy["spec"]["ingress"][0][
        "from"
    ]
    assert admitted(policy, {**pod, "status": {}}) and not admitted(policy, sibling)


def test_without_a_label_of_its_own_the_notebook_is_admitted_by_address_alone_with_one_warning(caplog):
    from cmlcluster.backends.kubernetes import session_objects

    session_objects._warned_unlabelled.discard("jupyter-carol-5d8f7c9b4-x2x9z")
    carol = notebook_pod("jupyter-carol-5d8f7c9b4-x2x9z", NOTEBOOK_POD["uid"], "10.244.0.9")
    replica = notebook_pod("jupyter-carol-5d8f7c9b4-q8k2m", "3e0a", "10.244.0.8")
    core = FakeCore([carol, replica], may_patch_pods=False)
    with caplog.at_level("WARNING", logger=session_objects.__name__):
        first = session_policy(core, "jupyter-carol-5d8f7c9b4-x2x9z")
        second = session_policy(core, "jupyter-carol-5d8f7c9b4-x2x9z", "b2c3d4")
    peers = first["spec"]["ingress"][0]["from"]
    assert [p for p in peers if "podSelector" in p and n.SESSION_LABEL not in p["podSelector"]["matchLabels"]] == []
    assert {"ipBlock": {"cidr": "10.244.0.9/32"}} in peers and {"ipBlock": {"cidr": "10.244.0.7/32"}} in peers
    assert admitted(first, carol) and not admitted(first, replica)
    assert second["spec"]["ingress"][0]["from"][1:] == peers[1:]
    warnings = [r.getMessage() for r in caplog.records if "has no label of its own" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, not once per session
    assert "'jupyter-carol-5d8f7c9b4-x2x9z'" in warnings[0] and "kubectl auth can-i patch pods" in warnings[0]
    assert "allow_from=" in warnings[0]


def test_without_options_workers_get_no_api_token_and_no_extras():
    pod_spec = make_pod()["spec"]
    assert pod_spec["automountServiceAccountToken"] is False
    for key in ("serviceAccountName", "nodeSelector", "tolerations", "imagePullSecrets"):
        assert key not in pod_spec, key


def test_pod_options_are_frozen_copies():
    selector = {"pool": "training"}
    tolerations = [{"key": "team", "operator": "Exists"}]
    env = {"A": "1"}
    names = ["regcred"]
    options = o.PodOptions(node_selector=selector, tolerations=tolerations, env=env, image_pull_secrets=names)
    selector["pool"] = "changed"
    tolerations[0]["key"] = "changed"
    env["B"] = "2"
    names.append("other")
    assert dict(options.node_selector) == {"pool": "training"}
    assert dict(options.tolerations[0]) == {"key": "team", "operator": "Exists"}
    assert dict(options.env) == {"A": "1"}
    assert options.image_pull_secrets == ("regcred",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.service_account = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(node_selector=["pool=training"]), r"node_selector=\['pool=training'\]"),
        (dict(node_selector={"pool": True}), r"node_selector\['pool'\]=True.*'true'"),
        (dict(node_selector={"bad key!": "x"}), r"node_selector key 'bad key!'"),
        (dict(node_selector={"pool": "-edge"}), r"node_selector\['pool'\]='-edge'"),
        (dict(tolerations={"key": "gpu"}), r"tolerations=\{'key': 'gpu'\}: give a list"),
        (dict(tolerations=[{"key": "gpu", "toleration_seconds": 5}]), r"unknown keys \['toleration_seconds'\]"),
        (dict(tolerations=[{"key": "gpu", "operator": "In"}]), r"operator='In'"),
        (dict(tolerations=[{"key": "gpu", "effect": "NoRun"}]), r"effect='NoRun'"),
        (dict(tolerations=[{"operator": "Equal", "value": "x"}]), r"has no key.*'Exists'"),
        (dict(tolerations=[{"key": "gpu", "operator": "Exists", "value": "x"}]), r"value='x'"),
        (dict(tolerations=[{"key": "gpu", "tolerationSeconds": 5}]), r"tolerationSeconds=5.*'NoExecute'"),
        (dict(service_account="Worker_SA"), r"service_account='Worker_SA'"),
        (dict(image_pull_secrets="regcred"), r"image_pull_secrets='regcred'.*\['regcred'\]"),
        (dict(image_pull_secrets=["reg cred"]), r"image_pull_secrets item='reg cred'"),
        (dict(env={"1ABC": "x"}), r"env: '1ABC' is not a valid variable name"),
        (dict(env={"CMLCLUSTER_CONNECTION": "x"}), r"'CMLCLUSTER_CONNECTION' is set by cmlcluster"),
        (dict(env={"CDSW_MASTER_IP": "x"}), r"'CDSW_MASTER_IP' is set by cmlcluster"),
        (dict(env={"N": 1}), r"env\['N'\]=1: values must be strings"),
        (dict(shared_volume="team-efs"), r"shared_volume='team-efs'.*SharedVolume"),
        (dict(fs_group=0), r"fs_group=0: give a non-root id"),
        (dict(run_as_user=0), r"run_as_user=0: give a non-root id"),
        (dict(run_as_user="1000"), r"run_as_user='1000'"),
        (dict(work_size="0Gi"), r"work_size='0Gi': give a storage quantity greater than 0"),
        (dict(work_size="10 GB"), r"work_size='10 GB'"),
        (dict(ephemeral_storage=-1), r"ephemeral_storage=-1"),
        (dict(network_policy="off"), r"network_policy='off': give True or False"),
        (dict(allow_from={"ipBlock": {"cidr": "0.0.0.0/0"}}), r"allow_from=.*give a list of NetworkPolicy peers"),
        (dict(allow_from=[{"cidr": "10.0.0.0/8"}]), r"allow_from: \{'cidr'.*is not a NetworkPolicy peer"),
        (dict(allow_from=[{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]), r"an ipBlock stands alone"),
    ],
)
def test_bad_options_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        o.PodOptions(**kwargs)


@pytest.mark.parametrize(
    "claim, mount_path, message",
    [
        ("Team_EFS", "/shared", r"shared_volume claim='Team_EFS'"),
        ("team-efs", "shared", r"mount_path='shared'.*absolute"),
        ("team-efs", "/", r"mount_path='/'"),
        ("team-efs", "/var/run", r"mount_path='/var/run': overlaps /var/run/cmlcluster"),
        ("team-efs", "/var/run/cmlcluster/data", r"overlaps /var/run/cmlcluster"),
    ],
)
def test_bad_shared_volumes_are_refused_naming_the_value(claim, mount_path, message):
    with pytest.raises(ConfigError, match=message):
        o.SharedVolume(claim=claim, mount_path=mount_path)


def test_a_worker_pod_needs_an_image():
    with pytest.raises(ConfigError, match="image=''"):
        m.worker_pod(
            make_spec(), session_id=SESSION, namespace=NAMESPACE, image="", secret_name="s", secret_uid=SECRET_UID
        )


# ---------------------------------------------------------------- names and label values


def test_valid_names_and_label_values_are_kept():
    assert n.dns_name("cmlcluster", "a1b2c3-12") == "cmlcluster-a1b2c3-12"
    assert n.pod_name("a1b2c3-12") == "cmlcluster-a1b2c3-12"
    assert n.label_value("a1b2c3-12") == "a1b2c3-12"
    assert n.label_value("Run_1.final") == "Run_1.final"


@pytest.mark.parametrize(
    "worker_id",
    ["Session_A-1", "x" * 80, "-leading-and-trailing-", "ünïcode-1", "a..b", "UPPER-1"],
)
def test_any_worker_id_gives_a_valid_pod_name_and_labels(worker_id):
    name = n.pod_name(worker_id)
    assert len(name) <= 63 and DNS_LABEL.fullmatch(name), name
    value = n.label_value(worker_id)
    assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
    pod = make_pod(make_spec(worker_id=worker_id))
    assert pod["metadata"]["name"] == name
    assert pod["metadata"]["labels"]["cmlcluster.io/worker"] == value
    assert_valid(pod)


def test_names_made_valid_stay_distinct():
    # Lowercasing alone would give both the same name; the hash of the original keeps them apart.
    assert n.pod_name("Session-1") != n.pod_name("session-1")
    assert n.pod_name("x" * 70 + "1") != n.pod_name("x" * 70 + "2")
    assert n.label_value("y" * 70 + "1") != n.label_value("y" * 70 + "2")
    assert n.pod_name("Session-1") == n.pod_name("Session-1")  # and are the same every time


# ---------------------------------------------------------------- the preflight asks for what the backend does

# A client method's resource, as RBAC names it. A method on a kind not named here fails the test
# below: say which resource it is (and add it to preflight.BACKEND_ACCESS).
RESOURCES = {"pod": "pods", "secret": "secrets", "network_policy": "networkpolicies", "namespace": "namespaces"}
RESOURCES |= {"node": "nodes"}
NOT_RESOURCES = {"self_subject_access_review"}  # always allowed
API_METHOD = re.compile(r"(create|read|list|patch|delete|replace|deletecollection)_(namespaced_)?([a-z_]+?)(_log)?")
VERBS = {"read": "get", "replace": "update"}


def backend_api_calls() -> set[tuple[str, str]]:
    """(verb, resource) of every Kubernetes API call in the backend's package, read from its source:
    each client method it names (core.read_namespaced_pod_log: get pods/log), and each watch of a
    list method (Watch().stream(core.list_namespaced_pod): watch pods)."""
    import ast
    from pathlib import Path

    from kubernetes import client

    from cmlcluster.backends import kubernetes as package

    trees = {path.name: ast.parse(path.read_text()) for path in Path(package.__file__).parent.glob("*.py")}
    # Every method of the client's API classes the package names (client.CoreV1Api...): what a call may be.
    classes = {
        name
        for tree in trees.values()
        for node in ast.walk(tree)
        for name in [getattr(node, "attr", None) or getattr(node, "id", None) or ""]
        if name.endswith("Api") and hasattr(client, name)
    }
    assert {"CoreV1Api", "NetworkingV1Api", "AuthorizationV1Api"} <= classes
    api_methods = {name for api in classes for name in vars(getattr(client, api)) if not name.startswith("_")}
    calls, unknown = set(), set()
    for filename, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "stream":
                method = node.args[0] if node.args else None
                if isinstance(method, ast.Attribute) and (match := API_METHOD.fullmatch(method.attr)):
                    calls.add(("watch", RESOURCES.get(match[3], match[3])))
            if not isinstance(node, ast.Attribute) or node.attr not in api_methods:
                continue
            if not (match := API_METHOD.fullmatch(node.attr)):
                unknown.add(f"{filename}: {node.attr}")
                continue
            verb, kind, sub = VERBS.get(match[1], match[1]), match[3], match[4]
            if kind in NOT_RESOURCES:
                continue
            if kind not in RESOURCES:
                unknown.add(f"{filename}: {node.attr}")
                continue
            calls.add((verb, RESOURCES[kind] + ("/log" if sub else "")))
    assert not unknown, f"API calls on kinds this test cannot name: {sorted(unknown)}"
    return calls


def test_the_preflights_list_is_exactly_what_the_backend_calls():
    from cmlcluster.backends.kubernetes import preflight

    listed = [(a.verb, a.resource) for a in preflight.BACKEND_ACCESS]
    assert len(listed) == len(set(listed))  # each once
    calls = backend_api_calls()
    assert {("patch", "secrets"), ("list", "secrets"), ("watch", "pods"), ("get", "pods/log")} <= calls  # it reads
    assert set(listed) == calls, f"called, not listed: {calls - set(listed)}; listed, not called: {set(listed) - calls}"
    for access in preflight.BACKEND_ACCESS:
        assert access.group == ("networking.k8s.io" if access.resource == "networkpolicies" else ""), access
        assert access.why and access.when in (
            preflight.ALWAYS,
            preflight.WITH_POLICY,
            preflight.OPTIONAL,
            preflight.CLEANUP,
        )


def _review_api(monkeypatch, denied: tuple[str, str] | None) -> list[tuple[str, str, str]]:
    """kubernetes.client's CoreV1Api and AuthorizationV1Api as check_access uses them, on a namespace
    where this user may do everything but `denied` (verb, resource[/subresource]). Returns the
    reviews asked for, (verb, resource, group)."""
    from types import SimpleNamespace

    from kubernetes import client

    asked: list[tuple[str, str, str]] = []

    class Core:
        def __init__(self, api):
            pass

        def read_namespace(self, name, **_):
            return None

    class Authorization:
        def __init__(self, api):
            pass

        def create_self_subject_access_review(self, body, **_):
            a = body.spec.resource_attributes
            what = a.resource + (f"/{a.subresource}" if a.subresource else "")
            asked.append((a.verb, what, a.group))
            return SimpleNamespace(status=SimpleNamespace(allowed=(a.verb, what) != denied, reason="RBAC: no Role"))

    monkeypatch.setattr(client, "CoreV1Api", Core)
    monkeypatch.setattr(client, "AuthorizationV1Api", Authorization)
    return asked


def _check_access(network_policy: bool = True) -> None:
    from types import SimpleNamespace

    from cmlcluster.backends.kubernetes import preflight

    api = SimpleNamespace(configuration=SimpleNamespace(host="https://k8s.example:6443"))
    preflight.check_access(api, NAMESPACE, notebook_pod=None, image_pull_secrets=(), network_policy=network_policy)


def _needed() -> list:
    from cmlcluster.backends.kubernetes import preflight

    return [a for a in preflight.BACKEND_ACCESS if a.when not in (preflight.OPTIONAL, preflight.CLEANUP)]


@pytest.mark.parametrize("access", _needed(), ids=lambda a: f"{a.verb} {a.resource}")
def test_each_thing_the_backend_does_is_checked_before_anything_starts(monkeypatch, access):
    _review_api(monkeypatch, (access.verb, access.resource))
    what = f"{access.resource}.{access.group}" if access.group else access.resource
    with pytest.raises(ConfigError, match=rf"may not {access.verb} {re.escape(what)} in namespace 'ml-team'") as e:
        _check_access()
    assert f"kubectl auth can-i {access.verb} {what} -n ml-team" in str(e.value)
    assert access.why in str(e.value)  # why the backend needs it


def test_what_is_optional_or_off_is_not_asked_for(monkeypatch):
    from cmlcluster.backends.kubernetes import preflight

    asked = _review_api(monkeypatch, ("patch", "pods"))  # refused: the notebook is admitted by address
    _check_access()
    assert ("list", "secrets", "") not in asked  # cleanup's alone: a session never lists them
    assert asked == [(a.verb, a.resource, a.group) for a in _needed()]
    asked.clear()
    _check_access(network_policy=False)
    assert asked == [(a.verb, a.resource, a.group) for a in _needed() if a.when == preflight.ALWAYS]
