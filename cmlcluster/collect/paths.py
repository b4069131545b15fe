"""What a run's workers bring home: the paths a user names with collect=, and which files of them count.

On CML every worker writes to the project's shared disk, so a script that saves ``outputs/model.keras``
finds it in the notebook's folder afterwards. Where workers start in a folder of their own, removed when
they end (SSH hosts, Docker without the working folder mounted, pods off the shared volume),
``collect=["outputs"]`` makes that so again: when a worker ends (success, failure or stop), what it wrote
under those paths lands at the same relative paths in the session's working folder. Both sides read the
rules here: the worker's side (backends/results_host.py, on an SSH host or in a pod's agent:
collect/in_worker.py) that keeps the files before the folder goes, and the session's side
(backends/results_home.py) that writes them into the session's folder.

- Paths are relative to the worker's working folder: "outputs", "checkpoints/", "model.keras", "." (all of
  it); never absolute, never through "..", never empty. Refused before anything starts.
- A worker's files are those it wrote or changed: modified from CHANGED_MARGIN seconds before the worker
  started. The files shipped to it (ship_working_folder=True) keep their old times, so a worker that only
  read a shipped checkpoint does not bring its stale copy back over another worker's new one.
- At most CAP_BYTES and CAP_FILES per worker; past either the rest stays behind, and a warning says so.
- A collect= path that is a link is followed while it stays inside the working folder; links below it
  stay behind (a warning names them), so nothing is ever read or written through one out of a folder.

The session's side trusts nothing the stream says (a worker's program, or whoever took its host, writes
it): it writes only files that `asked_for` says the run named, never through a link, never over a file
that was there before, never with set-id bits (collect/home.py).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable

from ..errors import ConfigError

CAP_BYTES = 1 << 30  # per worker: 1 GiB (CMLCLUSTER_COLLECT_CAP_MB changes it)
CAP_FILES = 10_000  # per worker (CMLCLUSTER_COLLECT_CAP_FILES changes it)
# A file's time comes from the kernel's coarse clock, a tick behind time.time(): one written at once
# after the start can look older than it. Shipped files are older than their launch by far more.
CHANGED_MARGIN = 1.0
NAMED = 5  # files a warning names


def check_collect(collect: object) -> tuple[str, ...]:
    """The collect= paths, normalized ("checkpoints/" -> "checkpoints"), each once; ConfigError naming a
    bad one and the fix. A single string is one path."""
    if collect is None:
        return ()
    if isinstance(collect, (str, os.PathLike)):
        collect = [collect]
    if not isinstance(collect, Iterable) or isinstance(collect, (bytes, dict)):
        raise ConfigError(
            f"collect={collect!r}: give a path or a list of paths relative to the worker's working folder, "
            "e.g. collect=['outputs', 'model.keras']"
        )
    paths: list[str] = []
    for raw in collect:
        path = os.fspath(raw) if isinstance(raw, (str, os.PathLike)) else raw
        if not isinstance(path, str):
            raise ConfigError(f"collect entry {raw!r}: give a path as a string, e.g. 'outputs'")
        why = _refused(path)
        if why:
            raise ConfigError(f"collect entry {path!r}: {why}")
        paths.append(posixpath.normpath(path))
    # A path inside another named one comes with it, but for one it asks for only by name (asked_for:
    # "outputs/clone/.git" beside "outputs", ".config" beside ".").
    return tuple(dict.fromkeys(p for p in paths if not asked_for([q for q in paths if q != p], p)))


def covers(collect: Iterable[str], path: str) -> bool:
    """Whether `path` (relative to the working folder, "/"-separated) is one of the collect= paths or in one."""
    return any(c == "." or path == c or path.startswith(c + "/") for c in collect)


def asked_for(collect: Iterable[str], name: str) -> bool:
    """Whether a file `name` (relative, "/"-separated, normalized) that came from a worker is one the run's
    collect= paths ask for: one of them is `name` or a folder above it, and names every guarded part of
    it. Guarded: a .git or __pycache__ folder at any depth (git hooks run by themselves; a .pyc whose
    header matches a shipped module's time and size is imported in its place) and, under ".", the
    folder's hidden top-level entries (.git, .ipython, .bashrc, .local, ...: the settings and code that
    tools run by themselves). `collect=[".", "repo/.git"]` asks for that one .git, `"outputs"` for none
    below it."""
    parts = name.split("/")
    guarded = [i for i, part in enumerate(parts) if _guarded(part) or (i == 0 and part.startswith("."))]
    deepest = guarded[-1] if guarded else -1
    for path in collect:
        named = [] if path == "." else path.split("/")
        if len(named) > deepest and parts[: len(named)] == named:
            return True
    return False


GUARDED = (".git", "__pycache__")
# What a macOS (HFS+) folder name ignores, and Windows' trailing dots and spaces: ".g\u200cit" is .git there.
_IGNORED = dict.fromkeys([0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF])


def _guarded(part: str) -> bool:
    """Whether a folder named `part` is a .git or __pycache__ folder, as a case-insensitive file system has
    it (git's own rule for .git, verify_path)."""
    return part.translate(_IGNORED).rstrip(". ").casefold() in GUARDED


def _refused(path: str) -> str:
    """Why `path` cannot be a collect= path ("" when it can)."""
    if not path.strip():
        return "an empty path names nothing; give a folder or file the worker writes, e.g. 'outputs'"
    if "\0" in path:
        return "a path cannot hold a NUL character"
    if path.startswith("~"):
        return (
            "give a path relative to the worker's working folder (its home is not the session's); "
            f"e.g. {path.lstrip('~/') or 'outputs'!r}"
        )
    if os.path.isabs(path):
        return (
            "give a path relative to the worker's working folder, where it lands in the session's working "
            f"folder too (e.g. {path.strip('/').rpartition('/')[2] or 'outputs'!r}); an absolute path is the "
            "worker machine's, which the session does not mirror"
        )
    if ".." in path.replace("\\", "/").split("/"):
        return "'..' would leave the worker's working folder; name a path inside it, e.g. 'outputs'"
    return ""


def cap_bytes() -> int:
    raw = os.environ.get("CMLCLUSTER_COLLECT_CAP_MB", "")
    try:
        return int(float(raw) * 2**20) if raw else CAP_BYTES
    except ValueError:
        raise ConfigError(f"CMLCLUSTER_COLLECT_CAP_MB={raw!r}: give a number of megabytes, e.g. 4096") from None


def cap_files() -> int:
    raw = os.environ.get("CMLCLUSTER_COLLECT_CAP_FILES", "")
    try:
        return int(raw) if raw else CAP_FILES
    except ValueError:
        raise ConfigError(f"CMLCLUSTER_COLLECT_CAP_FILES={raw!r}: give a number of files, e.g. 50000") from None


def changed(mtime: float, since: float) -> bool:
    """Whether a file modified at `mtime` is the worker's, whose folder was made at `since` (same clock)."""
    return mtime >= since - CHANGED_MARGIN


def size_text(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def listing(names: list[str], total: int | None = None) -> str:
    """A few names, and how many more."""
    total = len(names) if total is None else total
    shown = ", ".join(names[:NAMED])
    return shown + (f" and {total - min(len(names), NAMED)} more" if total > NAMED else "")
