"""The Docker engine beneath the docker backend: its client, the worker image, the shared network,
GPU requests, and the cleanup of containers that dead sessions left.

Every container cmlcluster starts carries labels (LABEL.session, .worker, the session's origin:
.host, .boot, .pidns, .pid, .start, and .controller) naming its session, the session's process
and where its controller listens; `remove_orphans` finds by them what a session that died
without stopping its workers left running.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .. import origin
from ..errors import ConfigError
from ..wire import CONNECTION_ENV
from .base import run_tag_labels

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "cmlcluster-worker:latest"  # built from the repository's Dockerfile
DEFAULT_NETWORK = "cmlcluster"
LABEL = "cmlcluster"  # label keys: cmlcluster.session, .worker, origin_labels()'s


def connect(timeout: int = 30) -> Any:
    """A docker SDK client, or a ConfigError that says how to start the engine."""
    try:
        import docker
    except ImportError as e:
        raise ConfigError("the docker backend needs the docker SDK: pip install 'cmlcluster[docker]'") from e
    try:
        client = docker.from_env(timeout=timeout, max_pool_size=64)
        client.ping()
    except Exception as e:
        raise ConfigError(
            f"no Docker engine answers ({e}). Start it: `dockerd &` as root, or `systemctl start docker`; "
            "scripts/docker_engine.sh does it for the tests"
        ) from None
    return client


def check_image(client: Any, image: str) -> None:
    """A ConfigError that says how to get `image` when the engine does not have it."""
    import docker.errors

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ConfigError(
            f"image={image!r} is not on this Docker engine; build it (docker build -t {image} .) "
            "or pass image= (the tests use cmlcluster-test:latest from scripts/docker_engine.sh)"
        ) from None


def check_gpu_runtime(client: Any, nvidia_gpu: int) -> None:
    """A ConfigError that says how to install it when the engine has no NVIDIA runtime."""
    runtimes = client.info().get("Runtimes", {})
    if "nvidia" not in runtimes:
        raise ConfigError(
            f"nvidia_gpu={nvidia_gpu}: this Docker engine has no GPU runtime (runtimes: "
            f"{', '.join(sorted(runtimes)) or 'none'}); install the NVIDIA Container Toolkit and run "
            "`nvidia-ctk runtime configure --runtime=docker`, then restart dockerd"
        )


def gpu_request(gpu_ids: Sequence[str], count: int) -> Any:
    """The device request for a worker's GPUs: these ids, or (ids unknown) any `count` of them."""
    from docker.types import DeviceRequest

    if gpu_ids:
        return DeviceRequest(device_ids=list(gpu_ids), capabilities=[["gpu"]])
    return DeviceRequest(count=count, capabilities=[["gpu"]])


def ensure_network(client: Any, name: str) -> str:
    """Make the user-defined bridge network `name` unless it exists; return its IPv4 gateway."""
    import docker.errors

    try:
        network = client.networks.get(name)
    except docker.errors.NotFound:
        try:
            network = client.networks.create(
                name, driver="bridge", check_duplicate=True, labels={f"{LABEL}.network": "1"}
            )
        except docker.errors.APIError as e:
            try:
                network = client.networks.get(name)  # another session made it meanwhile
            except docker.errors.NotFound:
                raise ConfigError(
                    f"network={name!r} could not be created: {e.explanation or e}. If its address "
                    "range clashes with another network, remove that one or create this one yourself with a "
                    f"free --subnet (docker network create --subnet 10.201.0.0/24 {name})"
                ) from None
        network.reload()
    if network.attrs.get("Driver") != "bridge":
        raise ConfigError(
            f"network={name!r} uses the {network.attrs.get('Driver')!r} driver; the docker backend "
            "needs a user-defined bridge network (pass another network=)"
        )
    configs = (network.attrs.get("IPAM") or {}).get("Config") or []
    gateways = [c["Gateway"] for c in configs if c.get("Gateway") and ":" not in c["Gateway"]]
    if not gateways:
        raise ConfigError(f"network={name!r} has no IPv4 gateway; workers could not reach the session")
    return str(gateways[0])


def origin_labels(env: Mapping[str, str]) -> dict[str, str]:
    """The labels that say which process a container's session is and where its controller listens
    (from the workers' environment `env`), for `remove_orphans`."""
    labels = {f"{LABEL}.{key}": value for key, value in origin.this_process().as_strings().items()}
    labels[f"{LABEL}.controller"] = origin.controller_address(env.get(CONNECTION_ENV, ""))
    return labels


def remove_orphans(client: Any = None, *, dry_run: bool = False) -> list[str]:
    """Remove containers labelled for a session that is gone; returns their names.

    Gone is origin.state's word: a session of this machine, boot and PID namespace whose
    process no longer runs and whose controller does not answer. Containers of sessions elsewhere,
    or whose labels cannot tell (an older cmlcluster's), are left alone, and under a run tag
    (CMLCLUSTER_RUN_TAG: a CI job's, a test run's) so are those of other runs.
    """
    client = client or connect()
    removed = []
    labels = [f"{LABEL}.session", *(f"{k}={v}" for k, v in run_tag_labels().items())]
    states: dict[str, str] = {}  # per session: its controller is asked once
    for container in client.containers.list(all=True, filters={"label": labels}, ignore_removed=True):
        found = container.labels
        session = found.get(f"{LABEL}.session", "")
        if session not in states:
            where = origin.Origin.from_strings({k[len(LABEL) + 1 :]: v for k, v in found.items()})
            states[session] = origin.state(where, found.get(f"{LABEL}.controller"))
            if states[session] == origin.ANSWERING:
                log.warning(
                    "cmlcluster cleanup: left the containers of session %s alone: its process looks gone, "
                    "but its controller at %s answers",
                    session,
                    found.get(f"{LABEL}.controller"),
                )
        if states[session] != origin.GONE:
            continue
        removed.append(container.name)
        if not dry_run:
            with contextlib.suppress(Exception):
                container.remove(force=True)
    return removed
