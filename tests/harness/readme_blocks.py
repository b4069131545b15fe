"""The README's ```python blocks, as a kernel would run them: each block a cell, top to bottom.

A block that cannot run on the machines the tests run on (it needs GPUs, or a Kubernetes API) is
an excerpt, and says so just before its fence, with its reason:

    <!-- excerpt: needs two GPUs -->
    ```python
    ...
    ```

Every other block runs as copied: tests/integration/test_readme_snippets.py runs them in one real
kernel started in the repository's root, and tests/unit/test_readme_blocks.py checks each is complete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

EXCERPT = re.compile(r"<!--\s*excerpt:(.*?)-->")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")


@dataclass(frozen=True)
class Block:
    line: int  # the line of its opening fence in README.md, from 1
    code: str
    excerpt: str | None  # the marker's reason ("" for a marker without one); None: no marker, it runs


@dataclass(frozen=True)
class StrayMarker:
    line: int
    text: str


def read(text: str | None = None) -> tuple[list[Block], list[StrayMarker]]:
    """The python blocks of the README (or of `text`), and the excerpt markers that precede none."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    strays: list[StrayMarker] = []
    marker: tuple[int, str] | None = None  # the last marker seen, waiting for its block
    index = 0
    while index < len(lines):
        line = lines[index]
        opened = FENCE.match(line)
        if opened:
            fence, language = opened.groups()
            end = next(
                (i for i in range(index + 1, len(lines)) if lines[i].strip().startswith(fence)),
                len(lines),
            )
            if language == "python":
                reason = marker[1] if marker else None
                blocks.append(Block(index + 1, "\n".join(lines[index + 1 : end]) + "\n", reason))
            elif marker:
                strays.append(StrayMarker(marker[0], lines[marker[0] - 1]))
            marker = None
            index = end + 1
            continue
        found = EXCERPT.search(line)
        if found or (line.strip() and marker):
            if marker:  # something other than the block came between a marker and a fence
                strays.append(StrayMarker(marker[0], lines[marker[0] - 1]))
            marker = (index + 1, found.group(1).strip()) if found else None
        index += 1
    if marker:
        strays.append(StrayMarker(marker[0], lines[marker[0] - 1]))
    return blocks, strays


def runnable(text: str | None = None) -> list[Block]:
    return [block for block in read(text)[0] if block.excerpt is None]
