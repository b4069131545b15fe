"""A program that prints for hours, in little: the notebook's client keeps none of its output while it
runs, a progress bar arrives as its last state, and an endless line is cut (cmlcluster.lines)."""

from __future__ import annotations

import os
import textwrap
import threading

import pytest

from cmlcluster import Session
from cmlcluster.lines import CUT_MARK, MAX_LINE_CHARS

pytestmark = pytest.mark.integration

LINES = 20_000
PRINTER = """
    import os, sys, time
    for i in range(LINES):
        print("line", i, "x" * 200)
    for i in range(5000):
        sys.stdout.write(f"\\rstep {i + 1}/5000")
        sys.stdout.flush()
    print()
    print("y" * (3 * MAX_LINE_CHARS))
    print("waiting", flush=True)
    while not os.path.exists(GO):
        time.sleep(0.05)
    print("the end")
"""


def test_a_running_programs_output_is_not_kept_by_the_client_and_bars_and_endless_lines_stay_small(tmp_path):
    go = tmp_path / "go"
    code = textwrap.dedent(PRINTER).replace("LINES", str(LINES)).replace("MAX_LINE_CHARS", str(MAX_LINE_CHARS))
    code = code.replace("GO", repr(str(go)))
    lines: list[str] = []
    dropped: list[int] = []
    waiting = threading.Event()

    def on_event(event) -> None:
        if event.kind == "output" and event.stream == "stdout":
            lines.append(event.text)
            if event.text == "waiting":
                waiting.set()
        elif event.kind == "lines_dropped":
            dropped.append(event.count)

    with Session("local", echo=False) as session:
        session.subscribe(on_event)
        [worker] = session.launch_workers(1, cpu=0.5, memory=0.5, code=code)
        assert waiting.wait(120), f"the program did not get through its output: {lines[-3:]}"
        # ~4.5 MB printed so far, and the program still runs: its request is open in the client.
        kept = {
            msg_id: len(md.get("stdout") or "")
            for msg_id, md in session.client.metadata.items()
            if isinstance(md, dict) and md.get("stdout")
        }
        assert kept == {}, f"the client keeps the running program's output: {kept}"
        go.touch()
        result = session.await_workers([worker], timeout_seconds=60)
        assert [w["status"] for w in result["workers"]] == ["succeeded"], result
        session.drain()
    # A subscriber the machine starves falls 10,000 events behind and misses the oldest of them, told how
    # many (events.py; seen on 2 busy cores): every line it got is whole and in order, and none is unaccounted.
    missed = sum(dropped)
    flood, tail = lines[: LINES - missed], lines[LINES - missed :]
    numbers = [int(text.split()[1]) for text in flood]
    assert flood == [f"line {i} {'x' * 200}" for i in numbers]
    assert numbers == sorted(set(numbers)) and len(numbers) + missed == LINES
    assert tail == ["step 5000/5000", "y" * MAX_LINE_CHARS + CUT_MARK, "waiting", "the end"]
    assert not os.path.exists(session.session_dir or "/nonexistent")


FLOOD = """
import sys
line = "x" * LINE + "\\n"
for i in range(COUNT):
    sys.stdout.write(line)
print("END", flush=True)
"""


def test_a_flooding_worker_always_ends_with_its_last_line_and_a_gap_is_said_where_it_is():
    # More than the session holds while its loop is behind (lines.MAX_RELAYED_CHARS): in long lines, which
    # the agent's stream sends as few big messages (before, one message past the cap was dropped whole with
    # the program's last line in it, and no notice was ever delivered: output() stayed empty), and in short
    # ones (before, a short last line could slip in beside what waited, ahead of the notice of the gap).
    shapes = [(1 << 20, 5), (99, 50_000)]  # (characters a line, lines): 5 MB each
    ends = []
    with Session("local", echo=False) as session:
        seen: list[tuple[str, str]] = []  # what the view hears: (worker, "END") and (worker, its end status)

        def on_event(event) -> None:
            if event.kind == "output" and event.text == "END":
                seen.append((event.source, "END"))
            elif event.kind == "status" and event.worker.status == "succeeded":
                seen.append((event.worker.id, "succeeded"))

        session.subscribe(on_event)
        for run in range(20):
            line, count = shapes[run % 2]
            code = FLOOD.replace("LINE", str(line)).replace("COUNT", str(count))
            [worker] = session.launch_workers(1, cpu=0.5, memory=0.5, code=code)
            result = session.await_workers([worker], timeout_seconds=120)
            assert [w["status"] for w in result["workers"]] == ["succeeded"], result
            output = session.output(worker).splitlines()
            ends.append(output[-1:])
            notices = [i for i, text in enumerate(output) if text.startswith("[cmlcluster: ") and "dropped" in text]
            # A gap, if the session fell behind, stands before the lines that came after it, never after END.
            assert all(i < len(output) - 1 for i in notices), output[-3:]
            whole = "x" * line if line <= MAX_LINE_CHARS else "x" * MAX_LINE_CHARS + CUT_MARK
            # Lines stay whole across a gap, but the one it began in, which ends where it stood.
            cut_short = {i - 1 for i in notices}
            assert all(text in (whole, "END") for i, text in enumerate(output) if i not in {*notices, *cut_short})
        session.drain()
    assert ends == [["END"]] * 20, ends
    # The view hears each worker's last line before it hears of its end.
    for worker_id in {w for w, _ in seen}:
        assert [what for w, what in seen if w == worker_id] == ["END", "succeeded"], seen
