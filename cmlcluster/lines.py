"""A program's output cut into lines in bounded memory, as a terminal would show them.

A program may print for hours: a tqdm bar rewrites one line with "\\r" for as long as it runs,
and a line may have no end at all. What is kept of a line still being written is what a
terminal shows of it (the text after its last carriage return, as ipyparallel's own client
reduces it), and at most MAX_LINE_CHARS of it: the rest of a longer line is dropped, and the
line ends with CUT_MARK.

OutputRelay carries a running program's output from the thread it arrives on to the
session's event loop, in bursts and in bounded memory.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

MAX_LINE_CHARS = 16_384
CUT_MARK = f" [cut by cmlcluster: line longer than {MAX_LINE_CHARS} characters]"
MAX_RELAYED_CHARS = 4 * 1024 * 1024  # output waiting for the session's loop; more is dropped (and said)


def visible(text: str) -> str:
    """What a terminal shows of `text` (no newline in it): what follows its last carriage return
    that more text follows, without a trailing "\\r" (a CRLF line's)."""
    if "\r" not in text:
        return text  # nearly every line: no scan
    shown = text.rstrip("\r")
    return shown[shown.rfind("\r") + 1 :]


class LineSplitter:
    """Text in (any chunks), whole lines out; what waits for its newline stays small."""

    def __init__(self, limit: int = MAX_LINE_CHARS):
        self.limit = limit
        self._partial = ""
        self._cut = False  # the line being written was too long: dropped until its newline

    def feed(self, text: str) -> list[str]:
        """The lines that `text` ends, in order, each as a terminal shows it."""
        *ended, rest = text.split("\n")
        lines = []
        if ended:
            if self._cut:
                self._cut = False  # the rest of a line whose cut beginning was already kept
            else:
                lines.append(self._line(self._partial + ended[0]))
            self._partial = ""
            limit = self.limit  # the common case, a short line without "\r", as it is: floods are long
            lines += [p if len(p) <= limit and "\r" not in p else self._line(p) for p in ended[1:]]
        if not self._cut:
            self._partial = _keep_visible(self._partial + rest)
            if len(self._partial) > self.limit:
                lines.append(self._line(self._partial))
                self._partial, self._cut = "", True
        return lines

    def flush(self) -> list[str]:
        """The line still being written, as it stands (the program ended without its newline)."""
        partial, cut = self._partial, self._cut
        self._partial, self._cut = "", False
        return [visible(partial)] if partial and not cut else []

    def _line(self, text: str) -> str:
        line = visible(text)
        return line[: self.limit] + CUT_MARK if len(line) > self.limit else line


def _keep_visible(partial: str) -> str:
    """A line still being written, less what a later "\\r" already wrote over; a trailing "\\r" stays
    (the newline that makes it a CRLF line may come in the next chunk)."""
    at = partial.rfind("\r", 0, len(partial) - 1)
    return partial[at + 1 :] if at >= 0 else partial


class OutputRelay:
    """A program's output, from the control plane's IO thread to `on_output(stream, text)` on `loop`.

    One loop callback per burst, not per message: a flood (tens of thousands of messages a
    second) would otherwise queue unbounded work on the loop, ahead of every call's reply, so
    that calls took longer the longer workers had printed. At most MAX_RELAYED_CHARS wait; when
    the loop falls that far behind, the oldest waiting text goes, not the newest: what a program
    printed last (how it ended) always arrives. Whole lines go: a line the gap began in ends where
    it stands, a line it ended in is dropped, and a line between them says how much went.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[str, str], None]):
        self._loop = loop
        self._on_output = on_output
        self._lock = threading.Lock()
        self._waiting: collections.deque[tuple[str, str]] = collections.deque()
        self._chars = 0
        self._dropped = 0  # from the start of what waits: the gap is before all of it
        self._gap_ends_mid_line: set[str] = set()  # streams whose last dropped text did not end a line
        self._delivered_mid_line: set[str] = set()  # streams whose last delivered text did not end a line
        self._scheduled = False

    def put(self, stream: str, text: str) -> None:
        """Any thread; the order of puts is the order of delivery."""
        with self._lock:
            self._waiting.append((stream, text))
            self._chars += len(text)
            while self._chars > MAX_RELAYED_CHARS:
                oldest_stream, oldest = self._waiting[0]
                over = self._chars - MAX_RELAYED_CHARS
                if len(oldest) > over and len(self._waiting) == 1:  # one text longer than all that may wait
                    gone, self._waiting[0] = oldest[:over], (oldest_stream, oldest[over:])
                else:
                    gone = self._waiting.popleft()[1]
                self._chars -= len(gone)
                self._dropped += len(gone)
                if gone.endswith("\n"):
                    self._gap_ends_mid_line.discard(oldest_stream)
                else:
                    self._gap_ends_mid_line.add(oldest_stream)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            burst, self._waiting = list(self._waiting), collections.deque()
            dropped, self._dropped = self._dropped, 0
            mid_line, self._gap_ends_mid_line = self._gap_ends_mid_line, set()
            self._chars = 0
            self._scheduled = False
        if dropped:
            burst, dropped = _from_line_starts(burst, dropped, mid_line)
            for stream in sorted(self._delivered_mid_line):  # the line the gap began in ends as it stands
                self._on_output(stream, "\n")
            self._delivered_mid_line.clear()
            self._on_output(
                "stderr", f"[cmlcluster: {dropped} characters of output dropped here: the session fell behind]\n"
            )
        for stream, text in burst:
            self._on_output(stream, text)
            if text.endswith("\n"):
                self._delivered_mid_line.discard(stream)
            else:
                self._delivered_mid_line.add(stream)


def _from_line_starts(
    burst: list[tuple[str, str]], dropped: int, mid_line: set[str]
) -> tuple[list[tuple[str, str]], int]:
    """`burst` without the rest of each line a gap ended in (`mid_line`'s streams), and the count of all
    that was dropped."""
    kept = []
    for stream, text in burst:
        if stream in mid_line:
            newline = text.find("\n")
            dropped += len(text) if newline < 0 else newline + 1
            if newline < 0:
                continue
            mid_line.discard(stream)
            text = text[newline + 1 :]
            if not text:
                continue
        kept.append((stream, text))
    return kept, dropped
