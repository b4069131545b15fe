"""Sphinx configuration of cmlcluster's documentation site (MyST Markdown, the PyData theme).

Build: sphinx-build -W --keep-going -b html docs docs/_build/html (tests/integration/test_docs.py does).
"""

from __future__ import annotations

import pathlib
import sys

from docutils.frontend import get_default_settings
from docutils.parsers.rst import Parser
from docutils.utils import new_document

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # autodoc imports this checkout's cmlcluster

project = "cmlcluster"
author = "cmlcluster's authors"
copyright = "cmlcluster's authors"

extensions = [
    "myst_nb",  # MyST Markdown pages, and the notebooks (it includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the public API's numpydoc sections (Parameters, Returns, Raises) as field lists
]

# notebooks/ is a link to the repository's notebooks: shown as they are in git, never run here
# (tests/integration/test_notebooks.py runs them on real kernels).
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links

exclude_patterns = ["_build"]
html_theme = "pydata_sphinx_theme"
html_title = "cmlcluster"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}

# The API reference: docstrings of the package's public names, as written (plain text with `code`).
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # a class without a docstring gets none, not abc.ABC's
autodoc_typehints = "signature"


def _rst_problems(text: str) -> bool:
    """Whether docutils would warn on `text` as reStructuredText."""
    settings = get_default_settings(Parser)
    settings.report_level = 5  # collect, print nothing
    settings.halt_level = 5
    document = new_document("<docstring>", settings)
    messages: list[int] = []
    document.reporter.attach_observer(lambda message: messages.append(message["level"]))
    Parser().parse(text, document)
    return any(level >= 2 for level in messages)


def _docstring_as_written(app, what, name, obj, options, lines: list[str]) -> None:
    """The package's docstrings are plain text, not reStructuredText: one that reST would read
    wrongly (an option list as a broken definition list, a `*` in `*args`) is shown as written,
    in a literal block, instead of failing the build or showing mangled."""
    if lines and _rst_problems("\n".join(lines)):
        lines[:] = ["::", "", *("    " + line for line in lines), ""]


def setup(app):
    app.connect("autodoc-process-docstring", _docstring_as_written)
