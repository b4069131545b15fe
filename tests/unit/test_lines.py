"""Output cut into lines in bounded memory, as a terminal shows them (cmlcluster.lines)."""

from __future__ import annotations

from cmlcluster.lines import CUT_MARK, LineSplitter, visible


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
