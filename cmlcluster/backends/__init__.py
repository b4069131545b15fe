"""Backends by name.

Built-in backends are listed as lazy import strings (so importing cmlcluster
never imports docker or kubernetes); third-party backends register under the
entry-point group ``cmlcluster.backends``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError
from .base import Backend, Capabilities, SessionContext

ENTRY_POINT_GROUP = "cmlcluster.backends"

# name -> (import string, what to install when the import fails)
BUILTIN: dict[str, tuple[str, str]] = {
    "local": ("cmlcluster.backends.local:LocalBackend", ""),
    "fake": ("cmlcluster.backends.fake:FakeBackend", ""),
    "docker": ("cmlcluster.backends.docker:DockerBackend", "pip install 'cmlcluster[docker]'"),
    "ssh": ("cmlcluster.backends.ssh:SSHBackend", ""),
    "kubernetes": ("cmlcluster.backends.kubernetes.backend:KubernetesBackend", "pip install 'cmlcluster[kubernetes]'"),
}


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[str]:
    return sorted(set(BUILTIN) | set(_entry_points()))


def backend_class(name: str) -> type[Backend]:
    """The class registered under `name`; an unknown name lists the known ones."""
    target = _entry_points().get(name) or BUILTIN.get(name, ("", ""))[0]
    if not target:
        raise ConfigError(
            f"backend={name!r} is not a known backend; choose one of {', '.join(known_backends())} "
            f"(or register one under the entry-point group {ENTRY_POINT_GROUP!r})"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = BUILTIN.get(name, ("", ""))[1]
        raise ConfigError(f"backend={name!r} could not be imported ({e}){'; ' + hint if hint else ''}") from e
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"backend={name!r} points at {target}, which is not a cmlcluster Backend")
    return cls


def make_backend(backend: str | Backend, **options: Any) -> Backend:
    """A backend instance from a name (plus options) or an instance."""
    if isinstance(backend, Backend):
        if options:
            raise ConfigError(
                f"backend options {sorted(options)} given with a backend instance; pass them to its class"
            )
        return backend
    if not isinstance(backend, str):
        raise ConfigError(f"backend={backend!r}: give a backend name such as 'local', or a Backend instance")
    return backend_class(backend)(**options)


__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "Capabilities",
    "SessionContext",
    "backend_class",
    "known_backends",
    "make_backend",
]
