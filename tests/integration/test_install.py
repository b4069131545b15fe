"""What scripts/install.sh leaves: every installed distribution's requirements hold (an extra that asks
for a newer numpy must not upgrade it under TensorFlow 2.15, which then no longer imports)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_pip_check_is_clean_in_the_venv():
    python = ROOT / ".venv" / "bin" / "python"
    assert python.exists(), ".venv is missing: scripts/install.sh dev makes it"
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
