"""`import cml.workers_v1` in a fresh Python that never imported cmlcluster, as on CML's runtimes: the
installed cmlcluster-cml.pth (setup.py) puts cmlcluster's finder for `cml` on sys.meta_path at every
interpreter start. Checked in the editable install scripts/install.sh makes (.venv) and in a fresh
venv with the wheel installed; a real `cml` wins in both, and nothing of cmlcluster is imported at
start."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
pytestmark = pytest.mark.integration

# What CML's runtimes let a project do, and that nothing of cmlcluster was imported before it.
CLIENT = """
import sys
assert not [m for m in sys.modules if m.startswith("cmlcluster")], "imported at start"
import cml.workers_v1 as workers
import cml.utils_v1
cdsw = cml.utils_v1._emulate_cdsw()
import cmlcluster.api
assert workers.launch_workers is cmlcluster.api.launch_workers and cdsw.stop_workers is cmlcluster.api.stop_workers
print(cml.__file__)
print(sum(bool(getattr(f, "cmlcluster_cml_finder", False)) for f in sys.meta_path))
"""


def run(python, code, cwd, env=None):
    done = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr  # a .pth that fails says so at every start
    return done.stdout.split()


def test_a_fresh_venv_python_imports_cml_workers_v1_without_importing_cmlcluster_first(tmp_path):
    assert VENV_PYTHON.exists(), ".venv is missing: scripts/install.sh dev makes it"
    cml_file, finders = run(VENV_PYTHON, CLIENT, tmp_path)
    assert cml_file == str(ROOT / "cmlcluster" / "cml_shim" / "cml" / "__init__.py")
    assert finders == "1"  # `import cmlcluster` added none beside the .pth's


def test_a_real_cml_wins_at_start_and_cmlcluster_is_not_imported(tmp_path):
    (tmp_path / "cml").mkdir()
    (tmp_path / "cml" / "__init__.py").write_text("REAL = True\n")
    code = "import sys, cml; assert cml.REAL; print(cml.__file__, 'cmlcluster' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert run(VENV_PYTHON, code, tmp_path / "cml", env) == [str(tmp_path / "cml" / "__init__.py"), "False"]


def test_an_unknown_name_is_still_not_found_and_costs_no_cmlcluster_import(tmp_path):
    code = (
        "import sys\ntry:\n    import cmlx\nexcept ImportError:\n    print('not found')\n"
        "print('cmlcluster' in sys.modules)"
    )
    assert run(VENV_PYTHON, code, tmp_path) == ["not", "found", "False"]


def test_the_wheel_installs_the_pth_and_cml_imports_in_a_fresh_venv(tmp_path):
    # The tree as git has it (others' build outputs left out), built as pip builds a wheel.
    source = tmp_path / "source"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z", "--", "cmlcluster", "jupyter-config"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in [f.decode() for f in files if f] + ["pyproject.toml", "setup.py", "README.md"]:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("cmlcluster-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [*pip, "--python", str(python), "install", "-q", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    purelib = pathlib.Path(run(python, "import sysconfig; print(sysconfig.get_path('purelib'))", tmp_path)[0])
    assert (purelib / "cmlcluster-cml.pth").read_text() == "import _cmlcluster_cml\n"
    # cmlcluster's requirements from .venv, after the wheel's own folder (a path line: .venv's .pth files,
    # its editable cmlcluster among them, are not run).
    (purelib / "zz-requirements.pth").write_text(sysconfig.get_path("purelib") + "\n")

    cml_file, finders = run(python, CLIENT, tmp_path)
    assert cml_file == str(purelib / "cmlcluster" / "cml_shim" / "cml" / "__init__.py")
    assert finders == "1"
