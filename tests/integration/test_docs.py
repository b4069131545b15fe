"""The documentation site (docs/) builds with warnings as errors, and the README's links into it hold.

Sphinx runs as `python -m sphinx` from the test's own interpreter (the venv), never looked up on PATH.
Warnings are errors: a link between pages that does not resolve, a page outside every toctree, a
docstring autodoc cannot import, fail the build.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# The public names the API reference must document (cmlcluster's face, and the backend classes).
PUBLIC = [
    "launch_workers",
    "await_workers",
    "list_workers",
    "stop_workers",
    "use_backend",
    "Session",
    "run_cluster",
    "start_cluster",
    "TFCluster",
    "run_horovod",
    "run_torch",
    "LocalBackend",
    "DockerBackend",
    "SSHBackend",
    "KubernetesBackend",
    "Backend",
    "Capabilities",
]


@pytest.mark.timeout(600)
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    out = tmp_path / "html"
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "docs", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    api = (out / "api.html").read_text()
    # autodoc gives each documented object an HTML id of its full name: id="cmlcluster.backends.ssh.backend.SSHBackend".
    missing = [name for name in PUBLIC if not re.search(rf'id="cmlcluster(\.\w+)*\.{name}"', api)]
    assert not missing, f"the API reference does not document {missing}"
    # Every notebook in the repository is rendered (not run: there are no outputs to check).
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    assert sorted(p.stem for p in (out / "notebooks").glob("*.html")) == notebooks
    assert (out / "listening.html").exists()


def test_the_readme_links_only_to_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    assert any(t.startswith("docs/") for t in targets), "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to {missing}, which do not exist"
