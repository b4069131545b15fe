"""Output cut into lines in bounded memory, as a terminal shows them (cmlcluster.lines)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from cmlcluster._aio import LoopThread
from cmlcluster.lines import CUT_MARK, MAX_RELAYED_CHARS, LineSplitter, OutputRelay, visible


def feed_all(splitter: LineSplitter, chunks: list[str]) -> list[str]:
    return [line for chunk in chunks for line in splitter.feed(chunk)] + splitter.flush()


def test_lines_come_whole_whatever_the_chunks():
    assert feed_all(LineSplitter(), ["a", "b\nc", "\n\nd"]) == ["ab", "c", "", "d"]


def test_a_progress_bar_keeps_only_its_last_state_and_crlf_lines_lose_their_cr():
    bar = [f"\r{i:3d}%|{'#' * (i // 10)}" for i in range(101)]
    assert feed_all(LineSplitter(), ["epoch 1\r\n", *bar, "\n", "done\r", "\n"]) == [
        "epoch 1",
        "100%|##########",
        "done",
    ]
    assert visible("abc\rxy") == "xy" and visible("abc\r") == "abc"


def test_a_bar_that_never_ends_its_line_holds_one_state_at_a_time():
    splitter = LineSplitter()
    for i in range(100_000):
        assert splitter.feed(f"\rstep {i}") == []
    assert len(splitter._partial) < 20
    assert splitter.flush() == ["step 99999"]


def test_a_line_longer_than_the_cap_is_cut_marked_and_the_rest_of_it_dropped():
    splitter = LineSplitter(limit=10)
    lines = feed_all(splitter, ["0123456789abc", "def" * 1000, "ghi\nnext\n"])
    assert lines == ["0123456789abc"[:10] + CUT_MARK, "next"]
    assert feed_all(LineSplitter(limit=10), ["0123456789\n"]) == ["0123456789"]  # at the cap: whole


def relay_on_a_loop(received: list[tuple[str, str]]):
    loop_thread = LoopThread(name="test-relay")
    loop = loop_thread.loop
    return loop_thread, loop, OutputRelay(loop, lambda stream, text: received.append((stream, text)))


@contextlib.contextmanager
def stuck(loop):
    """The loop, busy elsewhere until the block ends; then every callback scheduled meanwhile has run."""
    busy, release = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (busy.set(), release.wait()))
    assert busy.wait(5)
    try:
        yield
    finally:
        release.set()


def test_a_flood_reaches_the_loop_in_order_in_few_callbacks():
    received: list[tuple[str, str]] = []
    loop_thread, loop, relay = relay_on_a_loop(received)
    scheduled = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: scheduled.append(1) or original(*a)  # counts the loop's callbacks
    try:
        chunks = [(("stdout", "stderr")[i % 7 == 0], f"{i}\n") for i in range(50_000)]
        pusher = threading.Thread(target=lambda: [relay.put(*c) for c in chunks])
        pusher.start()
        pusher.join()
        loop_thread.run(asyncio.sleep(0.1))  # after every callback scheduled before it
        assert received == chunks
        assert len(scheduled) < len(chunks) / 10, len(scheduled)  # one per burst, not one per message
    finally:
        loop_thread.stop()


def test_output_waiting_for_a_stuck_loop_stays_bounded_keeps_the_newest_and_says_the_gap_where_it_is():
    received: list[tuple[str, str]] = []
    loop_thread, loop, relay = relay_on_a_loop(received)
    try:
        line = "x" * 99 + "\n"
        count = 3 * MAX_RELAYED_CHARS // len(line)
        with stuck(loop):
            for _ in range(count):
                relay.put("stdout", line)
            relay.put("stdout", "END\n")  # short: it would fit beside what waits, after a gap, were the newest dropped
            assert relay._chars <= MAX_RELAYED_CHARS
        loop_thread.run(asyncio.sleep(0.1))
        kept = sum(len(text) for stream, text in received if stream == "stdout")
        assert MAX_RELAYED_CHARS - len(line) < kept <= MAX_RELAYED_CHARS
        # The gap first, then the newest output, the program's last line at its end.
        note, *rest = received
        dropped = count * len(line) + len("END\n") - kept
        gap = f"[cmlcluster: {dropped} characters of output dropped here: the session fell behind]\n"
        assert note == ("stderr", gap)
        assert rest[-1] == ("stdout", "END\n") and all(r == ("stdout", line) for r in rest[:-1])
        relay.put("stdout", "after\n")  # caught up: nothing is dropped any more
        loop_thread.run(asyncio.sleep(0.1))
        assert received[-1] == ("stdout", "after\n") and len(received) == len(rest) + 2
    finally:
        loop_thread.stop()


def test_one_text_longer_than_all_that_may_wait_keeps_its_last_whole_lines():
    received: list[tuple[str, str]] = []
    loop_thread, loop, relay = relay_on_a_loop(received)
    try:
        with stuck(loop):
            relay.put("stdout", "a" * MAX_RELAYED_CHARS + "\nTHE END\n")
        loop_thread.run(asyncio.sleep(0.1))
        dropped = MAX_RELAYED_CHARS + 1  # the rest of the long line went with its start
        assert received == [
            ("stderr", f"[cmlcluster: {dropped} characters of output dropped here: the session fell behind]\n"),
            ("stdout", "THE END\n"),
        ]
    finally:
        loop_thread.stop()


def test_lines_stay_whole_around_a_gap_whatever_the_chunks():
    received: list[tuple[str, str]] = []
    loop_thread, loop, relay = relay_on_a_loop(received)
    text = "".join(f"line {i}\n" for i in range(1_000_000))
    try:
        relay.put("stdout", text[:1234])  # delivered before the loop is stuck: it ends mid-line
        loop_thread.run(asyncio.sleep(0.1))
        with stuck(loop):
            for at in range(1234, len(text), 1000):  # chunks that cut lines anywhere
                relay.put("stdout", text[at : at + 1000])
        loop_thread.run(asyncio.sleep(0.1))
        streams = "".join(t for s, t in received if s == "stdout").split("\n")
        notice = [i for i, (s, _) in enumerate(received) if s == "stderr"]
        assert len(notice) == 1
        before = "".join(t for s, t in received[: notice[0]] if s == "stdout")
        after = "".join(t for s, t in received[notice[0] + 1 :])
        # The line the gap began in ended as it stood; every line after the notice is whole, up to the last.
        assert before.endswith("\n") and before.split("\n")[-2] == text[:1234].split("\n")[-1]
        lines = after.splitlines()
        assert lines[-1] == "line 999999" and len(after) <= MAX_RELAYED_CHARS
        first = int(lines[0].split()[1])
        assert lines == [f"line {i}" for i in range(first, 1_000_000)]
        assert len(streams) > 2
    finally:
        loop_thread.stop()
