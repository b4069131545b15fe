"""cmlcluster._proc.python_module: `python -m` without the working folder on sys.path, with -P (3.11+) and
through its own bootstrap on Python 3.10 (no -P), for cmlcluster's modules and others alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cmlcluster import _proc

pytestmark = pytest.mark.timeout(60)

SHOW = "import json, sys; print(json.dumps({'argv': sys.argv[1:], 'json': json.__file__}))"


@pytest.fixture
def hostile(tmp_path):
    (tmp_path / "json.py").write_text("raise SystemExit('the working folder json.py ran')\n")
    (tmp_path / "runpy.py").write_text("raise SystemExit('the working folder runpy.py ran')\n")
    return tmp_path


@pytest.mark.parametrize("version", [(3, 10), sys.version_info[:2]], ids=["3.10 fallback", "this Python"])
@pytest.mark.parametrize("module", ["json.tool", "cmlcluster.backends.docker.reaper"])
def test_a_module_runs_with_its_arguments_and_nothing_from_the_working_folder(hostile, monkeypatch, module, version):
    monkeypatch.setattr(sys, "version_info", version)
    argv = _proc.python_module(module, "--help")
    assert argv[0] == sys.executable and ("-P" in argv) == (version >= (3, 11))
    done = subprocess.run(argv, cwd=hostile, capture_output=True, text=True, timeout=30)
    assert "working folder" not in done.stderr
    assert ("usage: python -m" in done.stdout + done.stderr) or done.returncode == 0, done.stderr


def test_the_fallback_passes_argv_as_python_m_does_and_finds_the_package_where_this_process_did(hostile, tmp_path):
    script = tmp_path / "elsewhere"
    script.mkdir()
    (script / "shower.py").write_text(SHOW)
    env = dict(os.environ, PYTHONPATH=str(script))
    argv = [sys.executable, "-c", _proc._RUN_MODULE, _proc._PACKAGE, "shower", "a", "--b=c", ""]
    done = subprocess.run(argv, cwd=hostile, env=env, capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip().startswith('{"argv": ["a", "--b=c", ""], "json": "')
    assert str(hostile) not in done.stdout


def test_the_helper_runs_this_processs_cmlcluster_not_another_one_installed(hostile, tmp_path):
    other = tmp_path / "site" / "cmlcluster"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise SystemExit('another cmlcluster ran')\n")
    env = dict(os.environ, PYTHONPATH=str(other.parent))  # before this one's on sys.path
    argv = _proc.python_module("cmlcluster.backends.docker.reaper")  # no session id: its usage, and exit 1
    done = subprocess.run(argv, cwd=hostile, env=env, capture_output=True, text=True, timeout=30)
    assert "another cmlcluster ran" not in done.stderr
    assert "usage: python -m cmlcluster.backends.docker.reaper" in done.stderr
