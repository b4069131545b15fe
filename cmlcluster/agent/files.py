"""Where a worker's shipped files are: unpacked there by the session's call, and found by relative name;
and what else its working folder holds when that folder is its own, removed with the worker.

The session ships scripts and folders as an archive (shipping.py) and has the agent unpack it
(``cmlcluster.agent.main:unpack_files``); what runs in the worker later (the program, a TensorFlow task, a
PyTorch node, sshd's sessions) finds them through `script_path` and `files_folder`.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import sys
import tarfile
import tempfile
from typing import Any

from .. import shipping
from ..collect import paths as results

_files_folder: str | None = None  # where shipped files were unpacked; relative scripts are found there
# The working folder the worker started in when it is its own, removed when it ends (wire.OWN_FOLDER_ENV; set
# by the agent at its start: a program may chdir elsewhere since); "" when it is shared.
own_folder = ""
# Its collect= paths (collect/paths.py): they come home when the worker ends, so they are not said to be lost.
collected: tuple[str, ...] = ()
# When the agent started (set by its main): files older than this came with the image or were shipped.
started = 0.0
# Files shipped into the working folder, by name there: (size, mtime) as unpacked. Not the program's.
_shipped: dict[str, tuple[int, int]] = {}
SCAN_LIMIT = 10_000  # files counted at most: a folder of a dataset's million files is not walked to its end
NAMED = 5  # entries a notice names


def unpack_files(archive: bytes, in_cwd: bool = False) -> str:
    """Unpack files shipped by the session; return the folder they are in.

    Into the working folder when it is the worker's own (in_cwd), else into a private
    folder in the worker's temp folder, so that nothing shipped overwrites a shared folder.
    """
    global _files_folder
    if in_cwd:
        _files_folder = os.getcwd()
    folder = shipping.unpack(archive, files_folder())
    if in_cwd:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            for member in tar.getmembers():
                name = posixpath.normpath(member.name)
                with contextlib.suppress(OSError):  # a program already at work there may have moved it
                    info = os.lstat(os.path.join(folder, name))
                    _shipped[name] = (info.st_size, info.st_mtime_ns)
    return folder


def files_folder() -> str:
    """The folder shipped files go to in this worker (made on first use)."""
    global _files_folder
    if _files_folder is None:
        _files_folder = tempfile.mkdtemp(prefix="cmlcluster-files-")
    return _files_folder


def script_path(script: str) -> str:
    """Where a script named by the session is in this worker: shipped ones are relative names."""
    if os.path.isabs(script):
        return script
    return os.path.join(_files_folder or os.getcwd(), script)


def leftovers(folder: str = "") -> dict[str, Any] | None:
    """What the worker's own working folder (or `folder`) holds besides the files shipped into it,
    unchanged: its entries with files in them, biggest first ("checkpoints/" for a folder), the number of
    files and their bytes ("more": counting stopped at SCAN_LIMIT). None when nothing, or when the
    working folder is not the worker's own. Python's __pycache__ is not the program's work, and what
    collect= names comes home."""
    folder = folder or own_folder
    if not folder:
        return None
    sizes: dict[str, int] = {}
    files = 0
    for parent, folders, names in os.walk(folder):
        folders[:] = sorted(f for f in folders if f != "__pycache__")
        for name in names:
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if _shipped.get(relative) == (info.st_size, info.st_mtime_ns) or results.covers(collected, relative):
                continue
            top, below, _ = relative.partition("/")
            entry = f"{top}/" if below else top
            sizes[entry] = sizes.get(entry, 0) + info.st_size
            files += 1
            if files >= SCAN_LIMIT:
                return _found(folder, sizes, files, more=True)
    return _found(folder, sizes, files, more=False) if files else None


def _found(folder: str, sizes: dict[str, int], files: int, more: bool) -> dict[str, Any]:
    names = sorted(sizes, key=lambda n: (-sizes[n], n))
    return {"folder": folder, "names": names, "files": files, "bytes": sum(sizes.values()), "more": more}


def notice(worker: str, found: dict[str, Any]) -> str:
    """What is said of `found` (leftovers()) before it goes with the worker."""
    names = ", ".join(found["names"][:NAMED]) + (", ..." if len(found["names"]) > NAMED else "")
    keep = [name.rstrip("/") for name in found["names"][:NAMED]]
    count = f"{'at least ' if found['more'] else ''}{found['files']} file{'s' if found['files'] != 1 else ''}"
    count += f", {results.size_text(found['bytes'])}"
    return (
        f"worker {worker}'s working folder {found['folder']} holds {names} ({count}), "
        "which its program wrote there; the folder is the worker's own and is removed with it, so these files "
        "are gone once it ends. To have them in the session's working folder when a worker ends, launch with "
        f"collect={keep!r} (launch_workers, run_torch, run_horovod, run_cluster), or save them where the "
        "session's machine sees them (a shared folder, a path the backend mounts)"
    )


def say_leftovers() -> None:
    """In a program the session stopped (it cannot ask a busy worker): say what goes with the worker."""
    found = leftovers()
    if found is not None:
        print(f"cmlcluster: {notice(os.environ.get('CDSW_ENGINE_ID', 'this worker'), found)}", file=sys.stderr)
