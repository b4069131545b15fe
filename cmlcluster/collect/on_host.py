"""On an SSH host: a worker's collect= files, kept aside before its folder goes, until the session takes them.

ssh/remote.py removes a worker's folder when the worker ends. Just before, `keep` moves what the worker
wrote under its collect= paths (collect/paths.py: the files it changed, and of .git and __pycache__ folders and
"."'s hidden top-level entries only those a path names: results.asked_for; links stay behind) out of it, into
<temp folder>/cmlcluster-results-<uid>/<worker id>/files, with a report of what stayed behind. Moving,
not copying: a checkpoint folder costs no second copy on the host's disk. The session then runs

    python -m cmlcluster.collect.on_host send <worker id> <cap in bytes> <cap in files>

over ssh, which writes the files to its stdout as a tar stream (at most the session's caps of them) and
the report to its stderr as one JSON line, then removes them. A session that never comes for them (it
died, the host was cut off) leaves them there: the next worker kept on that host removes those older
than KEEP_DAYS, and so does the host's temp cleaning.

The root folder is in the host's temp folder, the login user's alone (0700); one that is not (someone
else's, a link, open to others) is never used: the report then says why nothing was kept.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from typing import IO, Any

from . import paths as results

KEEP_DAYS = 2.0
NOTED = 20  # names of what stayed behind, in a report
SEND_WAIT = 30.0  # seconds `send` waits for a worker's folder to go, its files kept
WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def results_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"cmlcluster-results-{os.getuid()}")


def own_root(make: bool) -> str:
    """The root folder, checked to be this user's alone (made with make=True); OSError when it is not."""
    root = results_root()
    if make:
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{root} is not a folder of this user's alone (a link, another user's, or open to others)")
    return root


def keep(work: str, worker_id: str, collect: Iterable[str], since: float) -> None:
    """Move the worker's collect= files out of `work` (its folder, about to be removed) for the session to
    take (see send). `since`: when the worker's folder was made (time.time()). Never raises: the folder
    is removed next whatever happens here, and the report says what went wrong."""
    collect = tuple(collect)
    if not collect or not WORKER_ID.fullmatch(worker_id):
        return
    report: dict[str, Any] = {"files": 0, "bytes": 0, "missing": [], "links": [], "over_cap": [], "errors": []}
    try:
        root = own_root(make=True)
        _sweep(root)
        kept = os.path.join(root, worker_id)
        shutil.rmtree(kept, ignore_errors=True)
        os.makedirs(os.path.join(kept, "files"), mode=0o700)
    except OSError as e:
        report["errors"].append(f"nothing was kept on the host: {e}")
        print(f"cmlcluster: {report['errors'][0]}", file=sys.stderr, flush=True)
        return
    try:
        mover = _Mover(work, os.path.join(kept, "files"), since, report)
        for path in collect:
            mover.move(path)
    except Exception as e:  # a report, so the session says it; the worker's folder goes next
        report["errors"].append(f"{type(e).__name__}: {e}")
    # Whole or not at all: `send` reads it as soon as it is there.
    with open(os.path.join(kept, "report.json.part"), "w") as f:
        json.dump(report, f)
    os.replace(os.path.join(kept, "report.json.part"), os.path.join(kept, "report.json"))


class _Mover:
    """Moves a worker's files (results.changed) from its folder into the kept folder."""

    def __init__(self, work: str, into: str, since: float, report: dict[str, Any]):
        self.work, self.into, self.since, self.report = work, into, since, report

    def move(self, path: str) -> None:
        """Everything under `path`. A path that is a link is followed while it stays in the working folder
        (its files come under the link's name); links below it stay behind, named in the report."""
        top = os.path.join(self.work, path)
        if not os.path.lexists(top):
            self.report["missing"].append(path)
            return
        resolved = os.path.realpath(top)
        if not _inside(resolved, os.path.realpath(self.work)):
            _note(self.report, "links", f"{path} -> {os.readlink(top) if os.path.islink(top) else resolved}")
            return
        if not os.path.isdir(resolved):
            self._one(resolved, path)
            return
        for parent, folders, names in os.walk(resolved):
            # What the session writes only when named (.git, __pycache__, "."'s hidden entries) stays.
            folders[:] = sorted(f for f in folders if results.asked_for((path,), self._name(path, resolved, parent, f)))
            for name in sorted(names) + [f for f in folders if os.path.islink(os.path.join(parent, f))]:
                relative = self._name(path, resolved, parent, name)
                if results.asked_for((path,), relative):
                    self._one(os.path.join(parent, name), relative)

    @staticmethod
    def _name(path: str, resolved: str, parent: str, name: str) -> str:
        """The name in the stream of `name` in `parent`, below the collect= path `path` (at `resolved`)."""
        return os.path.normpath(os.path.join(path, os.path.relpath(os.path.join(parent, name), resolved)))

    def _one(self, source: str, name: str) -> None:
        info = os.lstat(source)
        if stat.S_ISLNK(info.st_mode):
            _note(self.report, "links", f"{name} -> {os.readlink(source)}")
            return
        if not stat.S_ISREG(info.st_mode):
            return  # fifos, sockets, devices: nothing to carry
        if not results.changed(info.st_mtime, self.since):
            return  # shipped to it, unchanged
        destination = os.path.join(self.into, name)
        os.makedirs(os.path.dirname(destination), mode=0o700, exist_ok=True)
        try:
            os.rename(source, destination)
        except OSError:  # another file system (a mount in the working folder): a copy, then
            shutil.copy2(source, destination)


def _note(report: dict[str, Any], key: str, text: str) -> None:
    """One more of what stayed behind: counted, and named among the first NOTED."""
    report[f"{key}_count"] = report.get(f"{key}_count", 0) + 1
    if len(report[key]) < NOTED:
        report[key].append(text)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _sweep(root: str) -> None:
    """Remove what sessions that never came for their files left more than KEEP_DAYS ago."""
    old = time.time() - KEEP_DAYS * 86400
    with os.scandir(root) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime < old:
                    shutil.rmtree(entry.path, ignore_errors=True)


def send(worker_id: str, cap: int, out: IO[bytes], err: IO[str], cap_files: int | None = None) -> int:
    """Write a worker's kept files to `out` (a tar stream), at most `cap` bytes and `cap_files` files of
    them (the session's results.cap_bytes and cap_files), and its report to `err` (one JSON line), then
    remove them. The session checks the stream again (results_home): these caps spare it what it would
    drop. Nothing kept: no
    stream, a report saying so. Exit code 0; 1 when the stream broke off (the files stay); 2 for bad input."""
    if not WORKER_ID.fullmatch(worker_id):
        print(f"not a worker id: {worker_id!r}", file=err)
        return 2
    _wait_for_keep(worker_id)
    try:
        kept = os.path.join(own_root(make=False), worker_id)
        with open(os.path.join(kept, "report.json")) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print(json.dumps({"kept": False, "why": str(e)}), file=err)
        return 0
    try:
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name, path in _entries(os.path.join(kept, "files")):
                info = tar.gettarinfo(path, arcname=name)
                if info.islnk():  # a second name of a file sent already: sent again, as a file
                    info.type, info.linkname, info.size = tarfile.REGTYPE, "", os.lstat(path).st_size
                if not info.isreg():
                    continue
                if report["bytes"] + info.size > cap:
                    _note(report, "over_cap", name)
                    continue
                if cap_files is not None and report["files"] >= cap_files:
                    report.setdefault("over_files_cap", [])
                    _note(report, "over_files_cap", name)
                    continue
                with open(path, "rb") as f:
                    tar.addfile(info, f)
                report["files"] += 1
                report["bytes"] += info.size
        out.flush()
    except OSError as e:  # the session went away midway: the files stay, for KEEP_DAYS (see keep)
        print(json.dumps({"kept": True, "sent": False, "why": str(e)}), file=err)
        return 1
    print(json.dumps({"kept": True, **report}), file=err)
    shutil.rmtree(kept, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(results_root())  # the last one out; another worker's files keep it
    return 0


def _wait_for_keep(worker_id: str) -> None:
    """Wait while the worker's folder is still there without its files kept: its relay (ssh/relay.py)
    reports the worker's end to the session before it keeps them and removes the folder."""
    pattern = os.path.join(glob.escape(tempfile.gettempdir()), f"cmlcluster-{worker_id}-*")
    report = os.path.join(results_root(), worker_id, "report.json")
    deadline = time.monotonic() + SEND_WAIT
    while not os.path.exists(report) and glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.05)


def _entries(folder: str) -> Iterable[tuple[str, str]]:
    """(name in the stream, path) of every file under `folder` (kept: no links), in order."""
    for parent, folders, names in os.walk(folder):
        folders.sort()
        for name in sorted(names):
            path = os.path.join(parent, name)
            yield os.path.relpath(path, folder).replace(os.sep, "/"), path


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[0] != "send" or not all(a.isdigit() for a in argv[2:]):
        print(
            "usage: python -m cmlcluster.collect.on_host send <worker id> <cap in bytes> [<cap in files>]",
            file=sys.stderr,
        )
        return 2
    return send(argv[1], int(argv[2]), sys.stdout.buffer, sys.stderr, int(argv[3]) if len(argv) == 4 else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
