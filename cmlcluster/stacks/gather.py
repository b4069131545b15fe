"""A worker's side of an X-ray: the Python stack of every thread of its program and of every Python process
below its agent, gathered in seconds without stopping anything; JSON-able, for the session (report.py).

- The agent's own threads (a plain worker's program, a TensorFlow task: they run in the agent) are read
  from the interpreter itself; the agent's machinery (the engine, its watchdogs) is left out.
- A process below it is read through the faulthandler dump its rank runner armed (hook.py), where it
  armed one: processes that share one dump file (a rank's forked children inherit it) are asked one at a
  time, others all at once. Any other (a launcher, a program cmlcluster did not start as a rank), or one
  whose dump does not come (a stopped process), is read with py-spy where py-spy is installed and may
  attach, and the process's environment does not turn it off (wire.PY_SPY_ENV).

Each frame carries its line of source, read here, where the file is: the session may have no copy.
Runs on the agent's control thread (agent/engine.py), while the program runs on the main thread.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Collection, Iterable
from typing import Any

from .. import _lifeline
from ..wire import PY_SPY_ENV
from .hook import MEMFD_NAME, XRAY_SIGNAL

GATHER_SECONDS = 5.0  # a worker's whole gather; the session waits a little longer for its answer
DUMP_SECONDS = 2.0  # for the ranks' own dumps: the rest of the gather is py-spy's, for those that gave none
PY_SPY_PARALLEL = 16  # py-spy processes at once
DUMP_SETTLED_SECONDS = 0.03  # a dump file that stopped growing for this long holds the whole dump

Frame = list[Any]  # [file, line, function, source line]: outermost first in a thread's list
# Code with no file of its own that is not the user's: Python's frozen modules, and the function
# ipyparallel sends to call the agent ("<string>"). A cell's code runs as "<worker code>" (agent/program.py).
MACHINERY_PSEUDO_FILES = ("<frozen", "<string>")


def gather(seconds: float = GATHER_SECONDS) -> dict[str, Any]:
    """{"processes": [...], "seconds": s}: the agent's own process first (when its program has Python
    frames), then every Python process below it, each {"pid", "ppid", "command", "label", "via",
    "threads": [{"name", "frames"}], "error"}."""
    started = time.monotonic()
    deadline = started + seconds
    processes = [own] if (own := own_process()) is not None else []
    processes += below(deadline)
    return {"processes": processes, "seconds": round(time.monotonic() - started, 3)}


# ---------------------------------------------------------------- the agent's own threads


def own_process() -> dict[str, Any] | None:
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue  # the control thread, gathering
        frames = users_part([[f.filename, f.lineno, f.name] for f in traceback.extract_stack(frame)])
        if frames:
            threads.append({"name": names.get(ident, f"thread {ident:#x}"), "frames": frames})
    if not threads:
        return None  # no program runs: only the agent's machinery
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "command": "the worker's program",
        "label": label_of(dict(os.environ)) or tensorflow_task(),
        "via": "agent",
        "threads": main_first(threads),
        "error": None,
    }


def tensorflow_task() -> dict[str, Any]:
    """The TensorFlow task this agent serves (run_cluster's tasks run in their worker's agent), if any."""
    task = getattr(sys.modules.get("cmlcluster.tensorflow.task"), "current_task", None)
    return {"kind": "tensorflow", "task": task} if task else {}


def users_part(frames: list[Frame]) -> list[Frame]:
    """A thread's frames from the first that is neither the standard library's nor the agent's machinery
    (the engine, ipykernel, zmq, cmlcluster itself) on; none when there is none such."""
    machinery = _machinery_folders()
    for i, (filename, *_rest) in enumerate(frames):
        if not filename.startswith(machinery) and not filename.startswith(MACHINERY_PSEUDO_FILES):
            return frames[i:]
    return []


def _machinery_folders() -> tuple[str, ...]:
    folders = {os.path.dirname(os.__file__) + os.sep}  # the standard library
    # psutil: the agent's resource sampler (usage.py) runs in it every few seconds; an X-ray that caught it there
    # showed a "program" unit of no rank beside a torch node's ranks (a CI run of test_xray).
    for name in ("ipykernel", "ipyparallel", "zmq", "tornado", "traitlets", "jupyter_client", "cmlcluster", "psutil"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            folders.add(os.path.dirname(file) + os.sep)
    return tuple(folders)


def with_source(frames: Iterable[Frame]) -> list[Frame]:
    return [[file, line, function, linecache.getline(file, line).strip()] for file, line, function in frames]


# ---------------------------------------------------------------- the processes below the agent


def below(deadline: float, skip: Collection[int] = (), ranks_only: bool = False) -> list[dict[str, Any]]:
    """The Python processes below this one, read: all of them, or with ranks_only only the ranks and their
    children (what the session's own process started: horovodrun's ranks on the local backend), never
    those below a process in `skip` (the local workers' agents, which answer for their own)."""
    import psutil

    found: dict[int, dict[str, Any]] = {}
    no_py_spy: set[int] = set()
    children = psutil.Process().children(recursive=True)
    skipped = set(skip)
    for child in children:  # parents come before their children
        with contextlib.suppress(psutil.Error):
            if child.ppid() in skipped:
                skipped.add(child.pid)
    for child in children:
        if child.pid in skipped:
            continue
        with contextlib.suppress(psutil.Error):
            command = child.cmdline()
            if not is_python(child.exe(), command) or is_lifeline(command):
                continue
            env = child.environ()
            label = label_of(env)
            if ranks_only and not label:
                continue
            if env.get(PY_SPY_ENV) == "0":
                no_py_spy.add(child.pid)
            found[child.pid] = {
                "pid": child.pid,
                "ppid": child.ppid(),
                "command": " ".join(" ".join(command).split())[:300],  # on one line
                "label": label,
                "via": None,
                "threads": [],
                "error": None,
            }
    for record in found.values():  # a rank's own child processes (a data loader's) are not the rank
        parent = found.get(record["ppid"])
        if record["label"] and parent is not None and parent["label"].get("rank") == record["label"].get("rank"):
            record["label"] = {**record["label"], "helper_of": parent["pid"]}
    # The ranks' own dumps first (no ptrace, no process started per rank: an X-ray a second cost a 2-core
    # job nothing this way and 11 % through py-spy, bench/xray_cost.py), leaving py-spy time for the rest.
    unread = _read_dumps(list(found), found, min(deadline, time.monotonic() + DUMP_SECONDS))
    _read_with_py_spy(unread, found, deadline, no_py_spy)
    for record in found.values():  # a rank's stack from its script on, without its runner's frames
        for thread in record["threads"]:
            thread["frames"] = users_part(thread["frames"]) or thread["frames"]
    return sorted(found.values(), key=lambda r: r["pid"])


def is_python(executable: str, command: list[str]) -> bool:
    names = [os.path.basename(executable), os.path.basename(command[0]) if command else ""]
    return any(re.fullmatch(r"python[\d.]*", name) for name in names)


def is_lifeline(command: list[str]) -> bool:
    """cmlcluster's own _lifeline.py, which only waits for the process it holds: nothing of the job's."""
    return len(command) > 1 and command[1] == _lifeline.__file__


def label_of(env: dict[str, str]) -> dict[str, Any]:
    """What a process is in its job, from the variables its launcher gave it: {"kind", "rank", "size",
    "local_rank"} for a Horovod, JAX or PyTorch rank, {"kind": "tensorflow", "task": "worker:1"} for a
    TensorFlow task; {} for anything else."""
    for kind, rank, size, local in (
        ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
        ("jax", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", None),
        ("torch", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ):
        if rank in env and (kind != "torch" or "LOCAL_RANK" in env):
            with contextlib.suppress(ValueError):
                return {
                    "kind": kind,
                    "rank": int(env[rank]),
                    "size": int(env[size]) if env.get(size, "").isdigit() else None,
                    "local_rank": int(env[local]) if local and env.get(local, "").isdigit() else None,
                    "backend": _horovod_transport(env) if kind == "horovod" else None,
                }
    if "TF_CONFIG" in env:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            task = json.loads(env["TF_CONFIG"])["task"]
            return {"kind": "tensorflow", "task": f"{task['type']}:{task['index']}"}
    return {}


def _horovod_transport(env: dict[str, str]) -> str | None:
    """How horovodrun told a rank its collectives travel ("gloo"): its controller's, for a CPU tensor."""
    if env.get("HOROVOD_GLOO") == "1" or env.get("HOROVOD_CONTROLLER") == "gloo":
        return "gloo"
    return env.get("HOROVOD_CONTROLLER") or None


def _read_with_py_spy(pids: list[int], found: dict[int, dict[str, Any]], deadline: float, refused: set[int]) -> None:
    """Read what py-spy can of `pids` (whose dumps did not come); to each it cannot read, add why to its error."""
    py_spy = shutil.which("py-spy") or _beside_python("py-spy")
    asked = []
    for pid in pids:
        if pid in refused:
            _add_error(found[pid], f"py-spy is turned off for it ({PY_SPY_ENV}=0)")
        elif py_spy is None:
            _add_error(found[pid], "py-spy is not installed here")
        else:
            asked.append(pid)
    for start in range(0, len(asked), PY_SPY_PARALLEL):
        batch = asked[start : start + PY_SPY_PARALLEL]
        running = {
            pid: subprocess.Popen(
                [str(py_spy), "dump", "--json", "--pid", str(pid)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
            for pid in batch
        }
        for pid, process in running.items():
            try:
                out, err = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                out, err = b"", b"py-spy did not answer in time"
            threads = _py_spy_threads(out) if process.returncode == 0 else None
            if threads is None:
                said = err.decode(errors="replace").strip().splitlines() or ["failed"]
                _add_error(found[pid], f"py-spy: {said[0].removeprefix('Error: ')}")  # then its backtrace
            else:
                found[pid].update(via="py-spy", threads=threads, error=None)


def _add_error(record: dict[str, Any], why: str) -> None:
    record["error"] = f"{record['error']}; {why}" if record["error"] else why


def _beside_python(name: str) -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None


def _py_spy_threads(out: bytes) -> list[dict[str, Any]] | None:
    try:
        dump = json.loads(out)
    except ValueError:
        return None
    threads = []
    for thread in dump:
        frames = [[f["filename"], f["line"], f["name"]] for f in reversed(thread.get("frames") or [])]
        name = thread.get("thread_name") or f"thread {thread.get('os_thread_id') or thread.get('thread_id')}"
        threads.append({"name": name, "frames": frames})
    return main_first(threads)


# ---------------------------------------------------------------- faulthandler dumps (hook.py)


def _read_dumps(pids: list[int], found: dict[int, dict[str, Any]], deadline: float) -> list[int]:
    """Ask each process in `pids` that armed hook.py for its dump; return those that gave none (armed
    nothing, or stopped), each with why in its error. A round asks one process of each dump file (its
    inode) at once; what one dump file serves (a rank and its forked children) is asked for in rounds."""
    unread = []
    by_file: dict[int, list[tuple[int, int]]] = {}  # inode -> [(pid, descriptor of its dump file)]
    for pid in pids:
        opened = _open_dump_file(pid)
        if opened is None:
            _add_error(found[pid], "it armed no faulthandler dump (cmlcluster did not start it as a rank)")
            unread.append(pid)
            continue
        by_file.setdefault(os.fstat(opened).st_ino, []).append((pid, opened))
    try:
        while any(by_file.values()):
            asked = [queue.pop(0) for queue in by_file.values() if queue]
            sizes = {}
            for pid, fd in asked:
                sizes[pid] = os.fstat(fd).st_size
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, XRAY_SIGNAL)
            for pid, fd in asked:
                text = _dump_after(fd, sizes[pid], deadline)
                if text is None:
                    _add_error(found[pid], f"no faulthandler dump within {DUMP_SECONDS:g} s (is it stopped?)")
                    unread.append(pid)
                else:
                    found[pid].update(via="faulthandler", threads=faulthandler_threads(text), error=None)
                os.close(fd)
    finally:
        for queue in by_file.values():
            for _pid, fd in queue:
                os.close(fd)
    return unread


def _open_dump_file(pid: int) -> int | None:
    """A descriptor of the process's hook.py memory file, only if the process also catches XRAY_SIGNAL
    (its dump handler is in place): a process that does not would die of the signal."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        if not caught >> (XRAY_SIGNAL - 1) & 1:
            return None
        folder = f"/proc/{pid}/fd"
        for fd in os.listdir(folder):
            with contextlib.suppress(OSError):
                if os.readlink(os.path.join(folder, fd)) == f"/memfd:{MEMFD_NAME} (deleted)":
                    return os.open(os.path.join(folder, fd), os.O_RDONLY)
    except (OSError, StopIteration, ValueError):
        return None
    return None


def _dump_after(fd: int, size: int, deadline: float) -> str | None:
    """The text written to the dump file past `size`, once it stopped growing; None by the deadline."""
    last, settled_at = size, None
    while time.monotonic() < deadline:
        now = os.fstat(fd).st_size
        if now != last:
            last, settled_at = now, time.monotonic()
        elif settled_at is not None and time.monotonic() - settled_at >= DUMP_SETTLED_SECONDS:
            return os.pread(fd, now - size, size).decode(errors="replace")
        time.sleep(0.005)
    return None


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def faulthandler_threads(text: str) -> list[dict[str, Any]]:
    """faulthandler's dump ("Thread 0x... (most recent call first):" and its "File ..., line N in f" lines)
    as threads, outermost frame first. It names no thread, but walks the interpreter's threads from the
    newest: the main thread, the first of all, is the last it dumps."""
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        if match := _THREAD.match(line):
            threads.append({"name": f"thread {match.group(2)}", "frames": []})
        elif (match := _FRAME.match(line)) and threads:
            threads[-1]["frames"].insert(0, [match.group(1), int(match.group(2)), match.group(3)])
    if threads:
        threads[-1]["name"] = "MainThread"
    return main_first(threads)


def main_first(threads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The threads with their source lines, the main thread first. Where nothing named it (py-spy does
    not always), the one thread whose outermost frame is a module's top level is taken for it."""
    if not any(t["name"] == "MainThread" for t in threads):
        mains = [t for t in threads if t["frames"] and t["frames"][0][2] == "<module>"]
        if len(mains) == 1:
            mains[0]["name"] = "MainThread"
    for thread in threads:
        thread["frames"] = with_source(thread["frames"])
    return sorted(threads, key=lambda t: t["name"] != "MainThread")
