"""The linters are part of the suite: ruff (bandit rules included) and mypy on the package.

Each runs as `python -m` from the test's own interpreter (the venv), never looked up on PATH:
the README installs them into .venv, whose bin folder is not on PATH."""

from __future__ import annotations

import pathlib
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
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_two_test_modules_share_a_name():
    # The test folders are no packages: pytest imports each test module by its file name alone, and a
    # second one of the same name stops the whole run at collection ("import file mismatch").
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
