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
