"""The Docker engine beneath the docker backend: its client, the worker image, the networks,
GPU requests, and the cleanup of what dead sessions left.

Everything cmlcluster makes on the engine carries labels (session_labels: LABEL.session, the
session's origin .host, .boot, .pidns, .pid, .start, and the run tag) naming its session and the
session's process; containers also name their worker and where their controller listens
(.controller). `remove_orphans` finds by them what a session that died without closing left: its
containers, then its network.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import origin
from ...errors import BackendError, ConfigError, install_hint
from ...wire import CONNECTION_ENV
from ..base import run_tag_labels
from . import gateway as docker_gateway
from . import ranges as docker_ranges

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "cmlcluster-worker:latest"  # built from the repository's Dockerfile
LABEL = "cmlcluster"  # label keys: cmlcluster.session, .worker, .controller, session_labels()'s
SESSION_NETWORK_PREFIX = "cmlcluster-"  # a session's own network: cmlcluster-<session id>
# What Docker 20.10 to 27 say when every range of its default-address-pools is taken.
POOL_EXHAUSTED = (
    "could not find an available, non-overlapping",
    "all predefined address pools have been fully subnetted",
)


def connect(timeout: int = 30) -> Any:
    """A docker SDK client, or a ConfigError that says how to start the engine."""
    try:
        import docker
    except ImportError as e:
        hint = install_hint("docker", "'docker>=7'")
        raise ConfigError(f"the docker backend needs the docker SDK: {hint}") from e
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


def session_network_name(session_id: str) -> str:
    return f"{SESSION_NETWORK_PREFIX}{session_id}"


def session_network(client: Any, session_id: str) -> str:
    """Make the session's own bridge network (session_network_name); return its IPv4 gateway.

    Docker drops traffic between two user-defined bridge networks, so no other session's workers
    (nor any other container) reach this session's, whatever they listen on: TensorFlow's servers
    bind every interface (but for the moments while Docker 20.10 makes any network: docs/security.md).
    The session's machine reaches the gateway, where the controller listens."""
    import docker.errors

    name = session_network_name(session_id)
    labels = {**session_labels(session_id), f"{LABEL}.network": "session"}
    # A session killed before it could close (a kernel restarted) left its network, and each holds
    # one of the engine's few address ranges: those of sessions that are gone go first.
    remove_orphan_networks(client, quiet=True)
    try:
        network = _create_with_range(client, name, labels)
    except docker.errors.APIError as e:
        explanation = str(e.explanation or e)
        if any(words in explanation for words in POOL_EXHAUSTED):
            raise ConfigError(
                f"Docker has no free address range for this session's network {name!r} ({explanation}): each "
                "network takes a range from the engine's default-address-pools (about 30 on a default engine). "
                "`cmlcluster cleanup` removes the networks of sessions that are gone; `docker network ls` shows "
                'the rest. Give the engine more, smaller ranges ("default-address-pools": [{"base": '
                '"10.200.0.0/16", "size": 24}] in /etc/docker/daemon.json, then restart dockerd), or share '
                "one network between sessions: DockerBackend(network='cmlcluster')"
            ) from None
        raise ConfigError(f"could not create this session's network {name!r}: {explanation}") from None
    network.reload()
    gateway = _gateway(network)
    docker_gateway.shut(name, gateway, docker_gateway.bridge_name(network.attrs))
    return gateway


def _create_with_range(client: Any, name: str, labels: Mapping[str, str]) -> Any:
    """The bridge network `name`, made with its range given (docker_ranges says why and how it is
    chosen); by an engine elsewhere, made with the range the engine picks, then made again with it."""
    import docker.errors
    from docker.types import IPAMConfig, IPAMPool

    info = client.info()
    if docker_ranges.engine_is_here(info):
        lost_to_others: list[docker_ranges.Range] = []
        for _ in range(5):
            taken = docker_ranges.network_ranges(client.networks.list())
            chosen = docker_ranges.free_range(
                docker_ranges.pools(info), [*taken, *docker_ranges.host_routes(), *lost_to_others]
            )
            if chosen is None:
                break  # every range is taken: the engine's own refusal below says so
            ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=str(chosen), gateway=str(chosen[1]))])  # .1: Docker's
            try:
                return client.networks.create(name, driver="bridge", labels=labels, ipam=ipam)
            except docker.errors.APIError as e:
                if "Pool overlaps" not in str(e.explanation or e):
                    raise
                lost_to_others.append(chosen)  # another session's network took it meanwhile
    return _pinned(client, client.networks.create(name, driver="bridge", labels=labels))


def _pinned(client: Any, network: Any) -> Any:
    """The network made again with the range the engine gave it, as the user's own (docker_ranges
    says why), for an engine whose host's routes this process cannot see: the engine's pool picks
    the range, so sessions never clash with each other's or the host's networks."""
    import docker.errors
    from docker.types import IPAMConfig, IPAMPool

    network.reload()
    attrs = network.attrs
    configs = [c for c in (attrs.get("IPAM") or {}).get("Config") or [] if ":" not in c.get("Subnet", ":")]
    if not configs:
        return network  # no IPv4 range to pin: replacements get any address (none needs one here)
    pool = IPAMPool(subnet=configs[0]["Subnet"], gateway=configs[0].get("Gateway"))
    network.remove()
    try:
        return client.networks.create(
            attrs["Name"], driver="bridge", labels=attrs.get("Labels"), ipam=IPAMConfig(pool_configs=[pool])
        )
    except docker.errors.APIError:
        # Another network took the range between the two calls: one of the pool's own again.
        return client.networks.create(attrs["Name"], driver="bridge", labels=attrs.get("Labels"))


def ensure_network(client: Any, name: str) -> str:
    """Make the user-defined bridge network `name` unless it exists; return its IPv4 gateway. A shared
    network (the network= opt-out): cmlcluster never removes it."""
    import docker.errors

    try:
        network = client.networks.get(name)
    except docker.errors.NotFound:
        try:
            network = client.networks.create(
                name, driver="bridge", check_duplicate=True, labels={f"{LABEL}.network": "shared"}
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
    return _gateway(network)


def _gateway(network: Any) -> str:
    name = network.attrs.get("Name")
    configs = (network.attrs.get("IPAM") or {}).get("Config") or []
    gateways = [c["Gateway"] for c in configs if c.get("Gateway") and ":" not in c["Gateway"]]
    if not gateways:
        raise ConfigError(f"network={name!r} has no IPv4 gateway; workers could not reach the session")
    return str(gateways[0])


def remove_network(client: Any, name: str) -> None:
    """Remove a session's network (its containers gone), and its gateway's firewall rule; one already
    gone is fine."""
    import docker.errors

    with contextlib.suppress(docker.errors.NotFound):
        client.networks.get(name).remove()
    docker_gateway.reopen(name)


def remove_session_network(client: Any, session_id: str) -> None:
    """Remove a closing session's own network; its workers were stopped, but a container whose stop
    could not remove it in time would still hold the network: such containers go first."""
    import docker.errors

    name = session_network_name(session_id)
    try:
        remove_network(client, name)
        return
    except docker.errors.APIError:
        pass
    for container in client.containers.list(
        all=True, filters={"label": f"{LABEL}.session={session_id}"}, ignore_removed=True
    ):
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
    try:
        remove_network(client, name)
    except docker.errors.APIError as e:
        explained = getattr(e, "explanation", None) or e
        raise BackendError(
            f"could not remove this session's network {name}: {explained}; the next session on this engine, "
            "or `cmlcluster cleanup`, removes it"
        ) from e


def session_labels(session_id: str) -> dict[str, str]:
    """The labels of everything a session makes on the engine: its id, its process's origin (which
    `remove_orphans` reads) and the run tag."""
    return {
        f"{LABEL}.session": session_id,
        **{f"{LABEL}.{key}": value for key, value in origin.this_process().as_strings().items()},
        **run_tag_labels(),
    }


def controller_label(env: Mapping[str, str]) -> dict[str, str]:
    """The label that says where a container's controller listens (from its worker's environment
    `env`), which `remove_orphans` asks before ending anything."""
    return {f"{LABEL}.controller": origin.controller_address(env.get(CONNECTION_ENV, ""))}


@dataclass
class SessionStates:
    """origin.state per session, asked once per session of the labels seen (its controller too)."""

    states: dict[str, str] = field(default_factory=dict)

    def of(self, labels: Mapping[str, str]) -> str:
        session = labels.get(f"{LABEL}.session", "")
        controller = labels.get(f"{LABEL}.controller")
        if session in self.states and not (controller and self.states[session] == origin.GONE):
            return self.states[session]
        # A network's labels name no controller (it is made before its controller listens): a
        # container of the same session asks it, then its answer holds for the network too.
        where = origin.Origin.from_strings({k[len(LABEL) + 1 :]: v for k, v in labels.items()})
        state = self.states[session] = origin.state(where, controller)
        if state == origin.ANSWERING:
            log.warning(
                "cmlcluster cleanup: left session %s alone: its process looks gone, but its controller at %s answers",
                session,
                controller,
            )
        return state


def remove_orphans(client: Any = None, *, dry_run: bool = False, states: SessionStates | None = None) -> list[str]:
    """Remove the containers labelled for a session that is gone; returns their names.

    Gone is origin.state's word: a session of this machine, boot and PID namespace whose
    process no longer runs and whose controller does not answer. Containers of sessions elsewhere,
    or whose labels cannot tell (an older cmlcluster's), are left alone, and under a run tag
    (CMLCLUSTER_RUN_TAG: a CI job's, a test run's) so are those of other runs.
    """
    client = client or connect()
    states = states or SessionStates()
    removed = []
    for container in client.containers.list(all=True, filters={"label": _owned()}, ignore_removed=True):
        if states.of(container.labels) != origin.GONE:
            continue
        removed.append(container.name)
        if not dry_run:
            with contextlib.suppress(Exception):
                container.remove(force=True)
    return removed


def remove_orphan_networks(
    client: Any = None, *, dry_run: bool = False, states: SessionStates | None = None, quiet: bool = False
) -> list[str]:
    """Remove the networks of sessions that are gone (as remove_orphans decides, with the states it
    found: call it first, so that their containers are gone); returns their names. Docker refuses
    to remove a network that a container still uses: it is left for the next cleanup (said in the
    log, unless quiet)."""
    import docker.errors

    client = client or connect()
    states = states or SessionStates()
    removed = []
    for network in client.networks.list(filters={"label": _owned()}):
        if states.of(network.attrs.get("Labels") or {}) != origin.GONE:
            continue
        if not dry_run:
            try:
                network.remove()
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                level = logging.DEBUG if quiet else logging.WARNING
                log.log(level, "cmlcluster cleanup: left network %s: %s", network.name, e.explanation or e)
                continue
            docker_gateway.reopen(network.name)
        removed.append(network.name)
    if not dry_run:
        docker_gateway.remove_stale()  # rules whose network went without them (removed by hand, say)
    return removed


def _owned() -> list[str]:
    """The label filter of what cleanup looks at: a session's, and under a run tag only that run's."""
    return [f"{LABEL}.session", *(f"{k}={v}" for k, v in run_tag_labels().items())]
