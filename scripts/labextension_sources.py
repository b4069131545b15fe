"""The hash of the JupyterLab panel's sources (labextension/), recorded beside the bundle built from them.

    python scripts/labextension_sources.py           # print the sources' hash
    python scripts/labextension_sources.py --write   # record it in the bundle's folder (build_labextension.sh)

CI never runs node: the built bundle (cmlcluster/lab/labextension/) is committed with its sources, and
tests/unit/lab/test_panel_data.py fails when the hash recorded there is not the hash of the sources now, i.e.
when a source changed and scripts/build_labextension.sh was not run again.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ROOT / "labextension"
BUNDLE = ROOT / "cmlcluster" / "lab" / "labextension"
RECORD = BUNDLE / "sources.sha256"
# What the bundle is built from: the TypeScript and styles, the build's settings and the locked packages.
FILES = ("package.json", "package-lock.json", "tsconfig.json", "install.json")
FOLDERS = ("src", "style")


def sources() -> list[pathlib.Path]:
    found = [SOURCES / name for name in FILES]
    for folder in FOLDERS:
        found += sorted(p for p in (SOURCES / folder).rglob("*") if p.is_file())
    return found


def digest() -> str:
    h = hashlib.sha256()
    for path in sources():
        data = path.read_bytes()
        h.update(f"{path.relative_to(SOURCES).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def recorded() -> str:
    return RECORD.read_text().split()[0] if RECORD.exists() else ""


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        RECORD.write_text(f"{digest()}  labextension/ sources (scripts/labextension_sources.py)\n")
    elif sys.argv[1:]:
        sys.exit(f"usage: {sys.argv[0]} [--write]")
    print(digest())
