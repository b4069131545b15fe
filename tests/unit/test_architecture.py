"""The package's shape: no import circles, no arrow pointing up a layer.

No line cap: a file's length measured the wrong thing (issue 36) and bent code to fit it; cohesion is what
splits a module."""

from __future__ import annotations

import pathlib
import subprocess
import sys

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
    assert edges["cmlcluster.session"] == {"cmlcluster.errors"}  # the TYPE_CHECKING import is no arrow
    assert edges["cmlcluster.sub.deep"] == {"cmlcluster.session"}  # a lazy import is one


def test_nothing_is_imported_by_a_name_string():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "cmlcluster").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "import_module(" in line and ("cmlcluster." in line or '"cmlcluster' in line)
    ]
    assert offenders == []
