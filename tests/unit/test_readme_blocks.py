"""Every python block of the README is complete as written, or marked as an excerpt with its reason; and
the README and the guide install cmlcluster as it is installed (from a clone: it is not on PyPI).

Fast and static: tests/integration/test_readme_snippets.py runs the blocks; this says, without running
anything, which block is incomplete and why (a placeholder, a name no block defines, a script that is not
in the repository, a GPU request, a comment that IPython would pass to a magic as its arguments).
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize

import pytest
from harness import readme_blocks
from IPython.core.inputtransformer2 import TransformerManager

TRANSFORM = TransformerManager()
CELL_MAGIC = re.compile(r"%%(\w+)")
SCRIPT = re.compile(r"(?<![\w/.-])([\w./-]+\.py)\b")
GPU_REQUEST = re.compile(r"--gpus[ =]+[1-9]|nvidia_gpu\s*=\s*[1-9]")
# What the kernel has without an import (IPython's own names)
KERNEL_NAMES = "from IPython import get_ipython\nfrom IPython.display import display\n"


def block_id(block: readme_blocks.Block) -> str:
    return f"line{block.line}"


def kernel_code(block: readme_blocks.Block) -> str:
    """What the kernel runs for the block: IPython's transform, magics as get_ipython() calls."""
    return TRANSFORM.transform_cell(block.code)


def scripts(block: readme_blocks.Block) -> list[tuple[int, str]]:
    """(README line, Python source) of what runs as Python: the cell, or a %%horovod cell's body, whose
    ranks run it as a script of its own."""
    magic = CELL_MAGIC.match(block.code)
    if magic:
        return [(block.line + 2, block.code.partition("\n")[2])]
    return [(block.line + 1, kernel_code(block))]


def code_without_comments(source: str) -> str:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return " ".join(t.string for t in tokens if t.type != tokenize.COMMENT)


def test_every_excerpt_marker_has_its_reason_and_its_block():
    blocks, strays = readme_blocks.read()
    assert not strays, "excerpt markers that precede no python block: " + ", ".join(
        f"README.md line {s.line}: {s.text}" for s in strays
    )
    unexplained = [b.line for b in blocks if b.excerpt == ""]
    assert not unexplained, f"excerpt markers without a reason before the blocks at README.md lines {unexplained}"


def test_excerpts_are_few():
    blocks, _ = readme_blocks.read()
    excerpts = [b for b in blocks if b.excerpt is not None]
    assert len(excerpts) <= len(blocks) // 3, f"{len(excerpts)} of {len(blocks)} python blocks are excerpts"


@pytest.mark.parametrize("block", readme_blocks.runnable(), ids=block_id)
def test_a_runnable_block_is_valid_python_as_a_kernel_reads_it(block):
    for line, source in scripts(block):
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            pytest.fail(f"README.md line {line + (e.lineno or 1) - 1}: {e.msg}")
        placeholders = [line + n.lineno - 1 for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value is ...]
        assert not placeholders, f"README.md lines {placeholders}: `...` is a placeholder, not code that runs"


@pytest.mark.parametrize("block", readme_blocks.runnable(), ids=block_id)
def test_a_runnable_block_names_only_scripts_that_exist(block):
    missing = [path for path in SCRIPT.findall(block.code) if not (readme_blocks.ROOT / path).is_file()]
    assert not missing, f"README.md line {block.line}: {missing} not in the repository (the kernel runs in its root)"


@pytest.mark.parametrize("block", readme_blocks.runnable(), ids=block_id)
def test_a_runnable_block_asks_for_no_gpu(block):
    requests = [m.group() for _, source in scripts(block) for m in GPU_REQUEST.finditer(code_without_comments(source))]
    first = block.code.partition("\n")[0]
    requests += GPU_REQUEST.findall(first) if CELL_MAGIC.match(first) else []
    assert not requests, (
        f"README.md line {block.line}: {requests}: no GPU here; say the GPU variant in a comment, "
        "or mark the block <!-- excerpt: needs GPUs -->"
    )


@pytest.mark.parametrize("block", readme_blocks.runnable(), ids=block_id)
def test_magics_are_written_as_ipython_reads_them(block):
    commented = [
        block.line + 1 + n
        for n, line in enumerate(block.code.splitlines())
        if line.lstrip().startswith("%") or re.match(r"\s*\w+\s*=\s*%", line)
        if "#" in line
    ]
    assert not commented, f"README.md lines {commented}: IPython passes a comment on a magic's line to the magic"
    late = [block.line + 1 + n for n, line in enumerate(block.code.splitlines()) if n and line.startswith("%%")]
    assert not late, f"README.md lines {late}: a cell magic is the first line of its block (a cell of its own)"


def undefined_names(source: str) -> list[dict]:
    """ruff's F821 (an undefined name) on `source`, as one module."""
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821", "--output-format=json", "-"],
        input=source,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.returncode in (0, 1), found.stderr
    return json.loads(found.stdout)


def test_runnable_blocks_use_only_names_defined_before_them():
    """Top to bottom in one kernel, as the integration test runs them; a %%horovod cell's body runs in
    the ranks, where the kernel's names are not."""
    module, lines = KERNEL_NAMES, [0] * KERNEL_NAMES.count("\n")  # the README line of each line of `module`
    cells = []
    for block in readme_blocks.runnable():
        for line, source in scripts(block):
            if CELL_MAGIC.match(block.code):
                cells.append((line, source))
                continue
            module += source
            lines += [line + n for n in range(source.count("\n"))]
    problems = [f"README.md line {lines[p['location']['row'] - 1]}: {p['message']}" for p in undefined_names(module)]
    for line, source in cells:
        problems += [
            f"README.md line {line + p['location']['row'] - 1}: {p['message']}" for p in undefined_names(source)
        ]
    assert not problems, "\n".join(problems)


# `pip install cmlcluster`, `pip install 'cmlcluster[widgets]'`, `pip install "cmlcluster==0.1"`: from PyPI
FROM_PYPI = re.compile(r"pip install (?:-\S+ )*['\"]?cmlcluster\b")


def test_install_words_install_from_the_clone():
    pages = [readme_blocks.README, *sorted((readme_blocks.ROOT / "docs").rglob("*.md"))]
    wrong = [
        f"{page.relative_to(readme_blocks.ROOT)}:{n}: {line.strip()}"
        for page in pages
        if "_build" not in page.parts
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if FROM_PYPI.search(line)
    ]
    assert not wrong, (
        "cmlcluster is not on PyPI: `bash scripts/install.sh <extras>` or `pip install -e '.[<extras>]'`\n"
        + ("\n".join(wrong))
    )


def test_the_reader_finds_markers_blocks_and_strays():
    text = "\n".join(
        [
            "<!-- excerpt: needs two GPUs -->",  # 1
            "```python",  # 2
            "train()",
            "```",
            "```python",  # 5
            "print(1)",
            "```",
            "<!-- excerpt: before a bash block -->",  # 8
            "```bash",
            "echo",
            "```",
            "<!-- excerpt: -->",  # 12
            "",
            "```python",  # 14
            "```",
            "<!-- excerpt: followed by prose -->",  # 16
            "some prose",
        ]
    )
    blocks, strays = readme_blocks.read(text)
    assert [(b.line, b.excerpt) for b in blocks] == [(2, "needs two GPUs"), (5, None), (14, "")]
    assert blocks[1].code == "print(1)\n"
    assert [s.line for s in strays] == [8, 16]
