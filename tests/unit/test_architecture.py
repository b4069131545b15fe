"""The package's shape: no import circles and no arrow pointing up a layer, counting type-only imports;
a family of modules is a package; a module past a soft size is said, and one past a hard one refused.

No line cap to squeeze under: a file's length measured the wrong thing (issue 36) and bent code to fit
it. Cohesion is what splits a module; the budget only catches one that grew past any reason."""

from __future__ import annotations

import collections
import pathlib
import subprocess
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import import_graph  # noqa: E402


def test_the_import_graph_has_no_circle_and_nothing_points_up():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_sees_a_circle_and_an_upward_arrow():
    edges = {"cmlcluster.workers": {"cmlcluster.session"}, "cmlcluster.session": {"cmlcluster.workers"}}
    assert import_graph.cycles(edges) == [["cmlcluster.session", "cmlcluster.workers"]]
    assert import_graph.upward(edges) == ["cmlcluster.workers (foundation) -> cmlcluster.session (session)"]


def test_every_module_has_a_layer():
    for module in import_graph.graph():
        import_graph.layer(module)  # raises, naming the module, when it has none


def test_the_graph_reads_relative_lazy_and_type_only_imports(tmp_path, monkeypatch):
    package = tmp_path / "cmlcluster"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "session.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import errors\nif TYPE_CHECKING:\n    from .sub import deep\n"
    )
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "deep.py").write_text("def f():\n    from ..session import x\n")
    monkeypatch.setattr(import_graph, "PACKAGE", package)
    edges = import_graph.graph()
    assert edges["cmlcluster.session"] == {"cmlcluster.errors", "cmlcluster.sub.deep"}  # type-only: an arrow
    assert edges["cmlcluster.sub.deep"] == {"cmlcluster.session"}  # a lazy import is one too
    assert import_graph.cycles(edges) == [["cmlcluster.session", "cmlcluster.sub.deep"]]


def test_nothing_is_imported_by_a_name_string():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "cmlcluster").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "import_module(" in line and ("cmlcluster." in line or '"cmlcluster' in line)
    ]
    assert offenders == []


# Lines past which a module is said (a warning in the run's summary), and refused.
SOFT_BUDGET, HARD_BUDGET = 500, 800


def families(names: list[str]) -> dict[str, list[str]]:
    """Sibling modules by the word before their first underscore, where three or more share it: agent_engine,
    agent_files, agent_program would be one (they became the agent package). Private modules (_proc) and
    dunder ones are no family."""
    by_prefix = collections.defaultdict(list)
    for name in names:
        if not name.startswith("_") and "_" in name:
            by_prefix[name.split("_", 1)[0]].append(name)
    return {prefix: sorted(found) for prefix, found in by_prefix.items() if len(found) >= 3}


def test_three_sibling_modules_with_one_prefix_are_a_package():
    found = {}
    for folder in [ROOT / "cmlcluster", *(p.parent for p in (ROOT / "cmlcluster").rglob("__init__.py"))]:
        names = [p.stem for p in folder.glob("*.py")] + [
            p.name for p in folder.iterdir() if (p / "__init__.py").exists()
        ]
        for prefix, members in families(names).items():
            found[f"{folder.relative_to(ROOT)}/{prefix}_*"] = members
    assert found == {}, f"make each a package: {found}"


def test_the_family_check_sees_one():
    assert families(["agent_engine", "agent_files", "agent_program", "agents", "_proc_a", "_proc_b", "_proc_c"]) == {
        "agent": ["agent_engine", "agent_files", "agent_program"]
    }
    assert families(["worker_env", "worker_logs", "workers", "session", "session_summary"]) == {}


def test_no_module_is_past_the_hard_budget_and_those_past_the_soft_one_are_said():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "cmlcluster").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    big = {name: n for name, n in sizes.items() if n > SOFT_BUDGET}
    if big:
        warnings.warn(f"modules past {SOFT_BUDGET} lines (split where cohesion says so): {big}", stacklevel=1)
    assert {name: n for name, n in big.items() if n > HARD_BUDGET} == {}
