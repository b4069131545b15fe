"""The linters are part of the suite: ruff (bandit rules included) and mypy on the package."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "ruff", "check", "."],
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        [sys.executable, "-m", "mypy"],
    ],
    ids=["ruff", "ruff-format", "mypy"],
)
def test_clean(argv):
    assert shutil.which("ruff") or argv[2] != "ruff"
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
