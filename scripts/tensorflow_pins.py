"""Print, on one line, the pip requirements that keep the TensorFlow installed in this Python as it is.

scripts/install.sh and scripts/build_horovod.sh add them to every pip install into .venv, so that pip
resolves what it installs together with TensorFlow's own requirements (numpy<2 for 2.15, ...) instead
of upgrading those under it: an installed distribution that no requirement names is outside pip's
resolution. Nothing is printed where this Python has no TensorFlow.

- Each distribution that holds the `tensorflow` package (tensorflow, tensorflow-cpu, ...), pinned to its
  installed version: pip keeps it, and resolves its requirements (and theirs) with the rest.
- setuptools<81 where TensorBoard is older than 2.21: it imports pkg_resources, which setuptools 81
  deprecates and 82 removed, and which its requirements do not say.

Usage: .venv/bin/python scripts/tensorflow_pins.py
"""

from __future__ import annotations

import importlib.metadata as metadata
import re


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def pins() -> list[str]:
    names = sorted(set(metadata.packages_distributions().get("tensorflow", [])))
    if not names:
        return []
    found = [f"{name}=={metadata.version(name)}" for name in names]
    try:
        tensorboard = metadata.version("tensorboard")
    except metadata.PackageNotFoundError:
        tensorboard = None
    if tensorboard is not None and release(tensorboard) < (2, 21):
        found.append("setuptools<81")
    return found


if __name__ == "__main__":
    print(" ".join(pins()))
