"""Backends by name: the one registry.

Built-in backends are listed here as lazy import strings (so importing cmlcluster
never imports docker or kubernetes); other packages' backends register under the
entry-point group ``cmlcluster.backends``, and cannot take a built-in's name.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Mapping
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
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN}


def known_backends() -> list[str]:
    return sorted(set(BUILTIN) | set(_entry_points()))


def backend_class(name: str) -> type[Backend]:
    """The class registered under `name`; an unknown name lists the known ones."""
    target = BUILTIN.get(name, ("", ""))[0] or _entry_points().get(name, "")
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


def resolve_backend(backend: str | Backend, options: Mapping[str, Any]) -> Backend | type[Backend]:
    """The backend instance, or the class a name stands for; nothing is constructed or started.

    Refuses what its construction would refuse for its names alone: an unknown backend name, options
    with an instance, and options its class's constructor does not take (checked against its
    signature, so that a typo is named before anything starts, not as a TypeError at the next launch).
    Values are the constructor's to check: building a backend may read files or ask for GPUs.
    """
    if isinstance(backend, Backend):
        if options:
            raise ConfigError(
                f"backend options {sorted(options)} given with a backend instance; pass them to its class"
            )
        return backend
    if not isinstance(backend, str):
        raise ConfigError(f"backend={backend!r}: give a backend name such as 'local', or a Backend instance")
    cls = backend_class(backend)
    _check_options(backend, cls, options)
    return cls


def _check_options(name: str, cls: type[Backend], options: Mapping[str, Any]) -> None:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor Python cannot describe checks its own arguments
        return
    try:
        signature.bind(**options)
    except TypeError as e:
        accepted = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        takes = f"its options are {', '.join(accepted)}" if accepted else "it takes no options"
        unknown = [option for option in options if option not in accepted]
        if not unknown:  # a required option is missing (a third party's backend); bind says which
            raise ConfigError(f"backend={name!r}: {e}; {takes}") from None
        named = []
        for option in unknown:
            close = difflib.get_close_matches(option, accepted, n=1)
            named.append(f"{option}={options[option]!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError(
            f"backend={name!r} has no option {', '.join(named)}; {takes} "
            f"(see help({cls.__module__}.{cls.__qualname__}))"
        ) from None


def make_backend(backend: str | Backend, **options: Any) -> Backend:
    """A backend instance from a name (plus options) or an instance."""
    resolved = resolve_backend(backend, options)
    return resolved if isinstance(resolved, Backend) else resolved(**options)


__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "Capabilities",
    "SessionContext",
    "backend_class",
    "known_backends",
    "make_backend",
    "resolve_backend",
]
