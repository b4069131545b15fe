"""setuptools' build (pyproject.toml holds the rest), plus two files at the top of site-packages:

    cmlcluster-cml.pth   one line, `import _cmlcluster_cml`, run by site at every interpreter start
    _cmlcluster_cml.py   a copy of cmlcluster/cml_shim/startup.py: the finder that answers for `cml`

so that `import cml.workers_v1` works in a fresh Python that never imported cmlcluster, as on CML's
runtimes (setuptools ships its distutils-precedence.pth the same way). A wheel gets them from
build_lib; an editable install (`pip install -e .`) from the editable wheel's own folder, because
setuptools' editable_wheel leaves build_lib out of it. The copy is made at install time: after an
edit of startup.py, install again.
"""

from __future__ import annotations

import os

from setuptools import Command, setup
from setuptools.command.build import build

PTH = "cmlcluster-cml.pth"  # its module imports nothing at start: cmlcluster only once `cml` is imported
MODULE = "_cmlcluster_cml.py"
STARTUP = os.path.join("cmlcluster", "cml_shim", "startup.py")


class build_cml_startup(Command):  # lower case, as setuptools names its commands
    description = "write cmlcluster-cml.pth and _cmlcluster_cml.py beside the packages"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode = False  # set by setuptools' editable_wheel

    def initialize_options(self) -> None:
        self.build_lib: str | None = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_lib", "build_lib"))

    def _target(self) -> str:
        if self.editable_mode:
            return self.get_finalized_command("install").install_lib  # the editable wheel's folder
        assert self.build_lib is not None
        return self.build_lib

    def run(self) -> None:
        target = self._target()
        self.mkpath(target)
        self.copy_file(STARTUP, os.path.join(target, MODULE))
        with open(os.path.join(target, PTH), "w", encoding="utf-8") as f:
            f.write("import _cmlcluster_cml\n")

    def get_outputs(self) -> list[str]:
        return [os.path.join(self._target(), name) for name in (PTH, MODULE)]

    def get_source_files(self) -> list[str]:
        return [STARTUP]


class build_with_cml_startup(build):
    sub_commands = [*build.sub_commands, ("build_cml_startup", None)]


setup(cmdclass={"build": build_with_cml_startup, "build_cml_startup": build_cml_startup})
