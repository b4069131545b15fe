"""Make the Jupyter of this environment load cmlcluster's JupyterLab panel from this checkout.

    .venv/bin/python scripts/link_labextension.py      (scripts/install.sh runs it after `pip install -e .`)

A wheel installs the panel as data files (pyproject.toml: share/jupyter/labextensions/cmlcluster-lab and
etc/jupyter/jupyter_server_config.d/cmlcluster.json). An editable install gets none of them: setuptools'
editable_wheel asks the distribution `has_data()`, which does not exist (the method is has_data_files),
so it never installs data files (seen with setuptools 80). So here, into sys.prefix as the wheel would:

- share/jupyter/labextensions/cmlcluster-lab: a symbolic link to the bundle in the checkout
  (cmlcluster/lab/labextension, named by the package's _jupyter_labextension_paths), what
  `jupyter labextension develop` makes, so that a rebuild (scripts/build_labextension.sh) is served at once;
- etc/jupyter/jupyter_server_config.d/cmlcluster.json: the same switch the wheel ships, enabling the
  server extension cmlcluster.lab.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmlcluster import lab  # noqa: E402

CONFIG = ROOT / "jupyter-config" / "jupyter_server_config.d" / "cmlcluster.json"


def main() -> None:
    prefix = pathlib.Path(sys.prefix)
    for path in lab._jupyter_labextension_paths():
        bundle = ROOT / "cmlcluster" / "lab" / path["src"]
        if not (bundle / "package.json").is_file():
            sys.exit(f"link_labextension.py: no bundle in {bundle}: run scripts/build_labextension.sh")
        target = prefix / "share" / "jupyter" / "labextensions" / path["dest"]
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)  # a copy, from a wheel installed before
        os.symlink(bundle, target, target_is_directory=True)
        print(f"{target} -> {bundle}")
    config = prefix / "etc" / "jupyter" / "jupyter_server_config.d" / CONFIG.name
    config.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONFIG, config)
    print(f"{config}: the server extension cmlcluster.lab enabled")


if __name__ == "__main__":
    main()
