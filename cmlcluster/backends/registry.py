"""Backends by name: the one registry.

Built-in backends are listed here as lazy import strings (so importing cmlcluster
never imports docker or kubernetes); other packages' backends register under the
entry-point group ``cmlcluster.backends``, and cannot take a built-in's name.
Read through the package (``from cmlcluster.backends import make_backend``).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError, install_hint
from .base import Backend

ENTRY_POINT_GROUP = "cmlcluster.backends"

# name -> (import string, what to install when the import fails)
BUILTIN: dict[str, tuple[str, str]] = {
    "local": ("cmlcluster.backends.local:LocalBackend", ""),
    "fake": ("cmlcluster.backends.fake:FakeBackend", ""),
    "docker": ("cmlcluster.backends.docker.backend:DockerBackend", install_hint("docker", "'docker>=7'")),
    "ssh": ("cmlcluster.backends.ssh.backend:SSHBackend", ""),
    "slurm": ("cmlcluster.backends.slurm.backend:SlurmBackend", ""),
    "kubernetes": (
        "cmlcluster.backends.kubernetes.backend:KubernetesBackend",
        install_hint("kubernetes", "'kubernetes>=29'"),
    ),
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


def options_of(name: str) -> dict[str, str]:
    """The options a backend takes, each with its default as text ("required" when it has none).

    The constructor's signature is the one description of a backend's options: this, the CLI's
    help and the error for an option it does not take all read it.
    """
    try:
        parameters = inspect.signature(backend_class(name)).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {
        p.name: "required" if p.default is inspect.Parameter.empty else repr(p.default)
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend NAME and --backend-option KEY=VALUE (repeatable), for a command that starts workers."""
    parser.add_argument(
        "--backend",
        default=None,
        help=f"where workers run: {', '.join(known_backends())} (default: CMLCLUSTER_BACKEND, or local); "
        "`cmlcluster backends` lists each one's options",
    )
    parser.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the backend, e.g. image=cmlcluster-worker:latest (a Python literal, else text)",
    )


def backend_from(arguments: argparse.Namespace) -> str | Backend | None:
    """The backend that add_backend_arguments' options name: None (the default), a name, or one built
    with its --backend-option values (checked against its options before anything starts)."""
    if not arguments.backend_option:
        return arguments.backend
    options: dict[str, Any] = {}
    for text in arguments.backend_option:
        key, sep, value = text.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--backend-option {text!r}: give KEY=VALUE, e.g. --backend-option image=worker:1")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value  # text, as typed
    return make_backend(arguments.backend or os.environ.get("CMLCLUSTER_BACKEND", "local"), **options)


def backends_help() -> str:
    """Every registered backend with its options, one a line (`cmlcluster backends`)."""
    lines = []
    for name in known_backends():
        try:
            options = options_of(name)
        except ConfigError as e:  # not installed here
            lines.append(f"{name}: {e}")
            continue
        described = ", ".join(f"{key}={default}" for key, default in options.items()) or "no options"
        lines.append(f"{name}: {described}")
    return "\n".join(lines)


def make_backend(backend: str | Backend, **options: Any) -> Backend:
    """A backend instance from a name (plus options) or an instance."""
    resolved = resolve_backend(backend, options)
    return resolved if isinstance(resolved, Backend) else resolved(**options)
