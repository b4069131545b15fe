"""Where a worker's shipped files are: unpacked there by the session's call, and found by relative name.

The session ships scripts and folders as an archive (shipping.py) and has the agent unpack it
(``cmlcluster.agent:unpack_files``); what runs in the worker later (the program, a TensorFlow task, a
PyTorch node, sshd's sessions) finds them through `script_path` and `files_folder`.
"""

from __future__ import annotations

import os
import tempfile

from . import shipping

_files_folder: str | None = None  # where shipped files were unpacked; relative scripts are found there


def unpack_files(archive: bytes, in_cwd: bool = False) -> str:
    """Unpack files shipped by the session; return the folder they are in.

    Into the working folder when it is the worker's own (in_cwd), else into a private
    folder in the worker's temp folder, so that nothing shipped overwrites a shared folder.
    """
    global _files_folder
    if in_cwd:
        _files_folder = os.getcwd()
    return shipping.unpack(archive, files_folder())


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
