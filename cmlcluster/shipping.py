"""Files that travel to workers: a script, a %%horovod cell, or the working folder, as a tar.gz.

Workers that do not see the session's files at the same paths (SSH hosts, containers without the
working folder mounted, pods) receive what a program needs as data over the control plane, and
unpack it in a folder of their own. Archives are built in memory, so their size is capped; past
the cap the error names the size and the ways out.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .workers import Program

DEFAULT_LIMIT_MB = 50.0  # per archive; CMLCLUSTER_SHIP_LIMIT_MB changes it


@dataclass(frozen=True)
class Shipment:
    """Files on their way to workers that do not see them (see plan)."""

    files: bytes  # a tar.gz, or b"" when the workers see everything already
    in_cwd: bool  # unpacked into the worker's own working folder, else into a private folder
    names: dict[str, str]  # a path on the session's machine -> how a program in the worker names it

    def program(self, **fields: Any) -> Program:
        """A Program carrying these files."""
        return Program(files=self.files, files_in_cwd=self.in_cwd, **fields)


def plan(scripts: Iterable[str], working_folder: bool, sees: Callable[[str], bool], cwd: str) -> Shipment:
    """What must travel so that workers can run these scripts (and, if asked, see the working folder).

    `sees(path)`: whether the workers see a path of this machine at that path (the backend's
    Capabilities.sees): nothing travels to them (local processes, a mounted folder).
    """
    in_cwd = not sees(cwd)  # then the worker's working folder is its own
    folder = cwd if working_folder and in_cwd else None
    names: dict[str, str] = {}
    files: dict[str, str] = {}
    for script in scripts:
        path = os.path.abspath(script)
        if sees(path):
            names[script] = path
        elif folder is not None and path.startswith(folder.rstrip("/") + "/"):
            names[script] = os.path.relpath(path, folder)  # travels with the folder
        else:
            name = os.path.basename(path)
            while name in files and files[name] != path:
                name = f"_{name}"  # two scripts of the same name from different folders
            files[name] = path
            names[script] = name
    archive = pack(files, folder) if files or folder else b""
    return Shipment(archive, in_cwd, names)


def limit_bytes() -> int:
    raw = os.environ.get("CMLCLUSTER_SHIP_LIMIT_MB", "")
    try:
        mb = float(raw) if raw else DEFAULT_LIMIT_MB
    except ValueError:
        raise ConfigError(f"CMLCLUSTER_SHIP_LIMIT_MB={raw!r}: give a number of megabytes, e.g. 200") from None
    return int(mb * 1024 * 1024)


def pack(files: Mapping[str, str], folder: str | None = None) -> bytes:
    """A tar.gz of {name in the archive: path on this machine}, and of everything under `folder`."""
    if folder is not None:
        _check_folder_size(folder)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        if folder is not None:
            tar.add(folder, arcname=".")
        for name, path in files.items():
            tar.add(path, arcname=name, recursive=False)
    return _checked(buffer.getvalue(), ", ".join([*([folder] if folder else []), *files.values()]))


def pack_text(name: str, text: str) -> bytes:
    """A tar.gz holding one file made from text (a notebook cell, say)."""
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _check_folder_size(folder: str) -> None:
    """Refuse a folder past the limit before reading it all into memory."""
    limit = limit_bytes()
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                total += os.path.getsize(path)
        if total > limit:
            break
    if total > limit:
        raise ConfigError(
            f"the working folder {folder} holds more than {limit / 2**20:.3g} MB, too much to ship to every worker "
            "over the control plane; ship less (run from a smaller folder), put data where the workers read it "
            "(a shared volume, object storage), or raise CMLCLUSTER_SHIP_LIMIT_MB"
        )


def _checked(archive: bytes, what: str) -> bytes:
    limit = limit_bytes()
    if len(archive) > limit:
        raise ConfigError(
            f"{what}: {len(archive) / 2**20:.1f} MB compressed, more than the {limit / 2**20:.3g} MB that is shipped "
            "to workers; put large files where the workers read them, or raise CMLCLUSTER_SHIP_LIMIT_MB"
        )
    return archive


def unpack(archive: bytes, folder: str) -> str:
    """Runs in a worker: unpack into `folder` (made if missing); nothing may land outside it."""
    os.makedirs(folder, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(folder, filter="data")  # refuses "..", links out of the folder, devices
        else:
            tar.extractall(folder, members=_inside(tar, folder))  # noqa: S202 - each member checked
    return folder


def _inside(tar: tarfile.TarFile, folder: str) -> list[tarfile.TarInfo]:
    """The members of `tar`, checked as tarfile's "data" filter does where Python lacks it."""
    root = os.path.realpath(folder)

    def within(path: str) -> bool:
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)  # root may be "/"

    members = []
    for member in tar.getmembers():
        member.name = member.name.lstrip("/")  # absolute names land inside the folder, as the filter does
        target = os.path.realpath(os.path.join(root, member.name))
        if not within(target):
            raise tarfile.TarError(f"{member.name!r} would land outside {root}")
        if member.issym() or member.islnk():
            base = os.path.dirname(target) if member.issym() else root
            if os.path.isabs(member.linkname) or not within(os.path.realpath(os.path.join(base, member.linkname))):
                raise tarfile.TarError(f"{member.name!r} links outside {root}")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise tarfile.TarError(f"{member.name!r} is not a file, folder or link")
        members.append(member)
    return members
