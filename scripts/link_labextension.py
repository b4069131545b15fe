"""Make the Jupyter of this environment load cmlcluster's JupyterLab panel from this checkout.

    .venv/bin/python scripts/link_labextension.py            (scripts/install.sh runs it after `pip install -e .`)
    .venv/bin/python scripts/link_labextension.py --remove   takes back what it wrote, nothing else

A wheel installs the panel as data files (pyproject.toml: share/jupyter/labextensions/cmlcluster-lab and
etc/jupyter/jupyter_server_config.d/cmlcluster.json). An editable install gets none of them: setuptools'
editable_wheel asks the distribution `has_data()`, which does not exist (the method is has_data_files),
so it never installs data files (seen with setuptools 80). So here, into sys.prefix as the wheel would:

- share/jupyter/labextensions/cmlcluster-lab: a symbolic link to the bundle in the checkout
  (cmlcluster/lab/labextension, named by the package's _jupyter_labextension_paths), what
  `jupyter labextension develop` makes, so that a rebuild (scripts/build_labextension.sh) is served at once;
- etc/jupyter/jupyter_server_config.d/cmlcluster.json: the same switch the wheel ships, enabling the
  server extension cmlcluster.lab.

pip knows of neither, so `pip uninstall` leaves them: --remove removes the link only where it still points
at this checkout's bundle, and the switch only where it still holds what was written (one edited since stays).
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


def written(prefix: pathlib.Path) -> tuple[list[tuple[pathlib.Path, pathlib.Path]], pathlib.Path]:
    """What main() writes under `prefix`: [(link, the bundle it points at)], and the switch's path."""
    links = [
        (prefix / "share" / "jupyter" / "labextensions" / path["dest"], ROOT / "cmlcluster" / "lab" / path["src"])
        for path in lab._jupyter_labextension_paths()
    ]
    return links, prefix / "etc" / "jupyter" / "jupyter_server_config.d" / CONFIG.name


def link(prefix: pathlib.Path) -> None:
    links, config = written(prefix)
    for target, bundle in links:
        if not (bundle / "package.json").is_file():
            sys.exit(f"link_labextension.py: no bundle in {bundle}: run scripts/build_labextension.sh")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)  # a copy, from a wheel installed before
        os.symlink(bundle, target, target_is_directory=True)
        print(f"{target} -> {bundle}")
    config.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONFIG, config)
    print(f"{config}: the server extension cmlcluster.lab enabled")


def remove(prefix: pathlib.Path) -> None:
    links, config = written(prefix)
    for target, bundle in links:
        if target.is_symlink() and pathlib.Path(os.readlink(target)) == bundle:
            target.unlink()
            print(f"{target}: removed")
        elif target.exists() or target.is_symlink():
            print(f"{target}: left alone (not the link to {bundle} this script makes)")
    if config.is_file() and not config.is_symlink() and config.read_bytes() == CONFIG.read_bytes():
        config.unlink()
        print(f"{config}: removed (the server extension cmlcluster.lab is no longer enabled here)")
    elif config.exists():
        print(f"{config}: left alone (not the switch this script writes)")


def main(argv: list[str]) -> int:
    if argv not in ([], ["--remove"]):
        print(f"link_labextension.py: {' '.join(argv)!r}: give no argument, or --remove", file=sys.stderr)
        return 2
    (remove if argv else link)(pathlib.Path(sys.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
