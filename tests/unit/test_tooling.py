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
    # pytest imports a test module by its name below the first folder up that is no package (tests/unit is
    # one, tests/integration is not): a second module of the same name stops the whole run at collection
    # ("import file mismatch").
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        parts, folder = [path.stem], path.parent
        while (folder / "__init__.py").exists():
            parts.insert(0, folder.name)
            folder = folder.parent
        names.setdefault(".".join(parts), []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_the_unit_tier_alone_imports_none_of_the_integration_harness():
    # tests/conftest.py loads harness.run, .leaks and .fixtures (processes, containers, SSH hosts) only for
    # a run with more than tests/unit; a unit test that needs one of their fixtures fails here.
    code = (
        "import sys, pytest;"
        "status = pytest.main(['-q', '-n', '0', '-p', 'no:cacheprovider', 'tests/unit/test_events.py']);"
        "print('LOADED', sorted(m for m in sys.modules if m.startswith('harness'))); sys.exit(status)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = result.stdout.split("LOADED ")[-1].strip()
    assert loaded == "['harness', 'harness.identity', 'harness.isolation']", loaded


def test_every_benchmark_imports_what_exists():
    # The benchmarks run by hand, so nothing else sees an import the code moved away from (bench/ssh_launch.py
    # imported `sshhosts` for a whole stop after the harness moved to tests/harness/). Each runs with its own
    # folder and tests/ on sys.path.
    import ast
    import importlib.util

    missing = []
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
    try:
        for script in sorted((ROOT / "bench").glob("*.py")):
            for node in ast.parse(script.read_text()).body:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                missing += [f"{script.name}: {n}" for n in names if importlib.util.find_spec(n) is None]
    finally:
        del sys.path[:2]
    assert missing == []
