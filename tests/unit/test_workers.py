"""The example notebooks name files as their kernel sees them: from their own folder, as JupyterLab opens them.

A quick check of what test_notebooks.py runs for real (integration): a path written from the project's
root fails at the first cell in JupyterLab, whose kernel for notebooks/X.ipynb works in notebooks/.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from cmlcluster.workers import user_file

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

# A file a cell names: a .py (a script for %horovod, %torchrun, script=, worker_script=) or a data file.
FILE = re.compile(r"""[\w./~-]+\.(?:py|csv|json|npz|npy|parquet|txt)\b""")


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_every_file_a_notebook_names_is_there_from_its_own_folder(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            for path in FILE.findall(cell.source):
                user_file(path, name=name, cwd=str(NOTEBOOKS))  # raises with the fix


def test_the_docs_show_the_same_notebooks():
    # One source: docs/notebooks is a link to notebooks/, never a copy that drifts.
    docs = NOTEBOOKS.parent / "docs" / "notebooks"
    assert docs.is_symlink() and docs.resolve() == NOTEBOOKS
