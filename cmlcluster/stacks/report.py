"""An X-ray as the notebook shows it: every rank's stacks (what each worker's agent gathered, gather.py),
grouped by identical stack, the odd ones out named with the line they stand at, and the collective the
others wait in; as text (print, %xray) and as HTML (a notebook's display, the session's widget).

A "unit" is what a job is made of: a rank (PyTorch, Horovod, JAX), a TensorFlow task, or a plain worker's
program. Processes that are none of these (torchrun, horovodrun, a rank's data loaders) are listed after.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    source: str = ""  # the line's text, read on the worker

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    @property
    def is_library(self) -> bool:
        """Python's own or an installed package's, not the user's code."""
        return self.file.startswith(("<frozen", "<string>")) or bool(_LIBRARY.search(self.file))

    def describe(self) -> str:
        return f"{self.where} in {self.function}" + (f": {self.source}" if self.source else "")


_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib/python\d[\d.]*/")


@dataclass(frozen=True)
class ThreadStack:
    name: str
    frames: tuple[Frame, ...]  # outermost first

    @property
    def innermost_users(self) -> Frame | None:
        """The innermost frame of the user's code (else the innermost of all): where the thread stands."""
        for frame in reversed(self.frames):
            if not frame.is_library:
                return frame
        return self.frames[-1] if self.frames else None


@dataclass(frozen=True)
class ProcessStacks:
    """One process's threads, and what it is in its job."""

    worker: str
    pid: int
    command: str
    via: str | None  # "py-spy", "faulthandler", "agent" (the worker's own program); None: no stacks read
    threads: tuple[ThreadStack, ...]
    error: str | None = None  # why no stacks were read
    kind: str | None = None  # "torch", "horovod", "jax", "tensorflow"; None: a plain worker's program or other
    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    task: str | None = None  # a TensorFlow task, "worker:1"
    backend: str | None = None  # the collectives' transport where the launcher says it ("gloo")
    helper_of: int | None = None  # the pid of the rank this process is a child of (a data loader)

    @property
    def is_unit(self) -> bool:
        if self.helper_of is not None:
            return False
        return self.rank is not None or self.task is not None or self.via == "agent"

    @property
    def role(self) -> str:
        """What it is compared with: a rank with ranks, a TensorFlow task with tasks of its type."""
        if self.rank is not None:
            return "rank"
        return self.task.partition(":")[0] if self.task else "program"

    @property
    def name(self) -> str:
        if self.rank is not None and self.helper_of is None:
            return f"rank {self.rank}"
        if self.task is not None:
            return self.task
        if self.via == "agent":
            return self.worker
        return f"{self.worker} pid {self.pid}"

    @property
    def main(self) -> ThreadStack | None:
        return self.threads[0] if self.threads else None  # the gatherer puts the main thread first

    @property
    def signature(self) -> tuple[Any, ...]:
        """What two units with the same stack share: their main thread's frames, each by its file's name,
        line and function (one script lies in a folder of each worker's own on SSH hosts)."""
        if self.main is None:
            return ("no stack", self.error)
        return tuple((os.path.basename(f.file), f.line, f.function) for f in self.main.frames)

    @property
    def collective(self) -> str | None:
        """The collective its main thread waits in ("torch.distributed.barrier"), if it waits in one: of the
        frames that name one, the outermost (the call the user made: allreduce, not the synchronize in it)."""
        if self.main is None:
            return None
        for frame in self.main.frames:
            for where, function, label in _COLLECTIVES:
                if where.search(frame.file) and function.search(frame.function):
                    name = label.format(function=frame.function.rpartition(".")[2])
                    return f"{name} over {TRANSPORTS.get(self.backend, self.backend)}" if self.backend else name
        return None

    @classmethod
    def from_wire(cls, worker: str, data: Mapping[str, Any]) -> ProcessStacks:
        label = data.get("label") or {}
        threads = tuple(
            ThreadStack(t["name"], tuple(Frame(str(f[0]), int(f[1]), str(f[2]), str(f[3])) for f in t["frames"]))
            for t in data.get("threads") or ()
        )
        return cls(
            worker=worker,
            pid=int(data["pid"]),
            command=str(data.get("command", "")),
            via=data.get("via"),
            threads=threads,
            error=data.get("error"),
            kind=label.get("kind"),
            rank=label.get("rank"),
            size=label.get("size"),
            local_rank=label.get("local_rank"),
            task=label.get("task"),
            backend=label.get("backend"),
            helper_of=label.get("helper_of"),
        )


TRANSPORTS = {"gloo": "Gloo", "nccl": "NCCL", "mpi": "MPI"}
NOTEBOOK = "notebook"  # the worker name of ranks the session's own process started (horovodrun's, on local)

# Where a stack's innermost frames say it waits for its peers: (file, function, label), tried innermost
# frame first. torch.distributed does not say which of Gloo and NCCL carries a group's collectives.
_COLLECTIVES = [
    (
        re.compile(r"torch/distributed/"),
        re.compile(
            r"(^|\.)(monitored_barrier|barrier|all_reduce\w*|all_gather\w*|all_to_all\w*|broadcast\w*|"
            r"reduce_scatter\w*|reduce|gather\w*|scatter\w*|send|recv|isend|irecv|wait)$"
        ),
        "torch.distributed.{function}",
    ),
    (
        re.compile(r"horovod/"),
        re.compile(
            r"(^|\.)(allreduce\w*|grouped_allreduce\w*|allgather\w*|broadcast\w*|alltoall\w*|"
            r"reducescatter\w*|synchronize|join|barrier)$"
        ),
        "Horovod {function}",
    ),
    (
        re.compile(r"jax/|jaxlib/"),
        re.compile(r"(^|\.)(psum|pmean|all_gather|block_until_ready|_sync\w*)$"),
        "JAX {function}",
    ),
    (
        re.compile(r"tensorflow/python/(distribute|training|eager|client)/"),
        re.compile(r"(^|\.)(join|fetch|done|wait\w*|_call_flat|quick_execute|_call_tf_sessionrun)$"),
        "TensorFlow's runtime (gRPC), in {function}",
    ),
]


QUIET = "no Python code of its own runs (no program, or only a server's threads: a parameter server)"


@dataclass
class XRay:
    """Every running worker's stacks, taken together, once. Print it, or display it in a notebook."""

    processes: list[ProcessStacks]
    unanswered: dict[str, str] = field(default_factory=dict)  # worker -> why it gave no stacks
    seconds: float = 0.0
    quiet: list[str] = field(default_factory=list)  # workers that answered with no Python of their own running

    @classmethod
    def from_answers(
        cls, answers: Mapping[str, Mapping[str, Any]], unanswered: Mapping[str, str], seconds: float
    ) -> XRay:
        """From each worker's gather (by the worker's name), and why the others gave none."""
        processes = [
            ProcessStacks.from_wire(worker, data) for worker, answer in answers.items() for data in answer["processes"]
        ]
        processes.sort(key=_order)
        quiet = [worker for worker, answer in answers.items() if not answer["processes"]]
        return cls(processes, dict(unanswered), seconds, quiet)

    @property
    def units(self) -> list[ProcessStacks]:
        return [p for p in self.processes if p.is_unit]

    @property
    def others(self) -> list[ProcessStacks]:
        return [p for p in self.processes if not p.is_unit]

    def groups(self) -> list[list[ProcessStacks]]:
        """The units grouped by identical stack, the largest group first."""
        return _grouped(self.units)

    def odd_ones_out(self) -> list[ProcessStacks]:
        """The units that stand apart from their peers (of the same role: a parameter server is no
        TensorFlow worker's peer): outside the one largest group where one group holds most; where none
        does, those not waiting in a collective while their peers are (one rank of two that never came)."""
        odd: list[ProcessStacks] = []
        for role in dict.fromkeys(u.role for u in self.units):
            peers = [u for u in self.units if u.role == role]
            groups = _grouped(peers)
            if len(groups) < 2:
                continue
            if len(groups[0]) >= 2 and len(groups[0]) > len(groups[1]):
                odd += [unit for group in groups[1:] for unit in group]
            elif any(u.collective for u in peers):
                odd += [u for u in peers if not u.collective]
        return sorted(odd, key=_order)

    def rank(self, rank: int) -> ProcessStacks:
        """The process of one rank (what `xray(rank=...)` shows)."""
        for unit in self.units:
            if unit.rank == rank:
                return unit
        known = ", ".join(str(u.rank) for u in self.units if u.rank is not None) or "none"
        raise KeyError(f"rank {rank} is not among this X-ray's ranks (ranks seen: {known})")

    # ---------------------------------------------------------------- as text

    def summary(self) -> list[str]:
        """The headline: who waits where, and the odd ones out."""
        units = self.units
        places = {p.worker for p in self.processes} | {*self.unanswered, *self.quiet}
        where = [_count(len(places - {NOTEBOOK}), "worker")] if places - {NOTEBOOK} else []
        where += ["the notebook's machine"] if NOTEBOOK in places else []
        vias = sorted({p.via for p in self.processes if p.via and p.via != "agent"})
        lines = [
            f"X-ray of {_count(len(units), _unit_word(units))} on {' and '.join(where) or '0 workers'} "
            f"in {self.seconds:.1f} s" + (f" ({', '.join(vias)})" if vias else "")
        ]
        odd = self.odd_ones_out()
        for group in self.groups():
            if odd and group[0] in odd:
                continue
            lines.append(f"  {_names(group)}: {_standing(group[0], plural=len(group) > 1)}")
        if odd:
            lines.append(f"  odd one{'s' if len(odd) > 1 else ''} out:")
            lines += [f"    {u.name} ({u.worker}, pid {u.pid}): {_standing(u)}" for u in odd]
        for worker, why in self.unanswered.items():
            lines.append(f"  {worker}: no answer ({why})")
        if self.quiet:
            lines.append(f"  {', '.join(self.quiet)}: {QUIET}")
        return lines

    def text(self) -> str:
        lines = self.summary()
        for group in self.groups():
            lines += ["", f"== {_names(group)} =="]
            lines += _stack_lines(group[0])
        if self.others:
            lines += ["", "== other processes ==", *self._other_lines()]
        return "\n".join(lines)

    def _other_lines(self) -> list[str]:
        """A line for each process that is no unit (a launcher, a rank's helper): where it stands."""
        lines = []
        for process in self.others:
            where = process.main.innermost_users if process.main else None
            standing = where.describe() if where else f"no stack: {process.error}"
            lines.append(f"  {process.name} ({_shortened(process.command)}): {standing}")
        return lines

    def __str__(self) -> str:
        return self.text()

    # ---------------------------------------------------------------- as HTML

    def html(self) -> str:
        e = html.escape
        parts = [f"<div class='cmlcluster-xray'><b>{e(self.summary()[0])}</b><ul>"]
        odd = self.odd_ones_out()
        for group in self.groups():
            style = " style='color:#c62828'" if odd and group[0] in odd else ""
            parts.append(
                f"<li{style}><b>{e(_names(group))}</b>: {e(_standing(group[0], plural=len(group) > 1))}"
                f"<details><summary>stack</summary><pre>{e(chr(10).join(_stack_lines(group[0])))}</pre></details></li>"
            )
        for worker, why in self.unanswered.items():
            parts.append(f"<li>{e(worker)}: no answer ({e(why)})</li>")
        if self.quiet:
            parts.append(f"<li>{e(', '.join(self.quiet))}: {e(QUIET)}</li>")
        parts.append("</ul>")
        if self.others:
            parts.append(
                "<details><summary>other processes</summary><pre>"
                + e("\n".join(self._other_lines()))
                + "</pre></details>"
            )
        parts.append("</div>")
        return "".join(parts)

    def _repr_html_(self) -> str:
        return self.html()


def _grouped(units: list[ProcessStacks]) -> list[list[ProcessStacks]]:
    grouped: dict[tuple[Any, ...], list[ProcessStacks]] = {}
    for unit in units:
        grouped.setdefault(unit.signature, []).append(unit)
    return sorted(grouped.values(), key=lambda g: (-len(g), _order(g[0])))


def _order(p: ProcessStacks) -> tuple[Any, ...]:
    return (p.rank is None, p.rank or 0, p.task or "", _worker_order(p.worker), p.pid)


def _worker_order(worker: str) -> tuple[Any, ...]:
    digits = re.sub(r"\D", "", worker)
    return (int(digits) if digits else 0, worker)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _unit_word(units: list[ProcessStacks]) -> str:
    if units and all(u.rank is not None for u in units):
        return "rank"
    if units and all(u.task is not None for u in units):
        return "task"
    return "program"


def _names(group: Iterable[ProcessStacks]) -> str:
    group = list(group)
    ranks = [u.rank for u in group if u.rank is not None]
    if len(ranks) == len(group) and len(group) > 1:
        return "ranks " + _ranges(sorted(ranks))
    return ", ".join(u.name for u in group)


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _standing(unit: ProcessStacks, plural: bool = False) -> str:
    """Where a unit (or each of a group) stands: its line of code, and the collective it waits in."""
    if unit.main is None:
        return f"no stack: {unit.error}"
    where = unit.main.innermost_users
    text = f"at {where.describe()}" if where else "no Python frames"
    collective = unit.collective
    return f"{'wait' if plural else 'waits'} in {collective}, {text}" if collective else text


def _shortened(command: str, width: int = 70) -> str:
    return command if len(command) <= width else command[: width - 1] + "…"


def _stack_lines(unit: ProcessStacks) -> list[str]:
    if unit.main is None:
        return [f"  no stack: {unit.error}"]
    lines = []
    for thread in unit.threads:
        lines.append(f"  {thread.name} (most recent call last):")
        for frame in thread.frames:
            lines.append(f"    {frame.file}:{frame.line} in {frame.function}")
            if frame.source:
                lines.append(f"      {frame.source}")
    return lines
