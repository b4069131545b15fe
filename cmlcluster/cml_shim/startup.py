"""Imported at every interpreter start by the installed `cmlcluster-cml.pth`, as the top-level module
`_cmlcluster_cml` (setup.py copies this file there): it appends to sys.meta_path a finder that answers
for `cml` only when every finder before it found none, so a real CML's `cml` always wins.

It imports nothing and costs one class and one append (bench/cml_startup.py measures it); cmlcluster
itself is imported only when `cml` is, by a Python that has no other. Nothing may raise here: an
error in a .pth's import is printed at every start of every program.
"""

import sys


class CmlFinder:
    cmlcluster_cml_finder = True  # cmlcluster.cml_shim.CML_FINDER: `import cmlcluster` adds no second

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname != "cml":
            return None
        try:
            from cmlcluster import cml_shim
        except Exception:  # cmlcluster broken or half uninstalled: `cml` is simply not found
            return None
        return cml_shim.find_spec(fullname, path, target, finder=CmlFinder)


if not any(getattr(finder, "cmlcluster_cml_finder", False) for finder in sys.meta_path):
    sys.meta_path.append(CmlFinder)
