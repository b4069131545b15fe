"""The README's first command (install, then the main job) works as written."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block, "the README must start with a bash block of set-up commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second():
    commands = setup_commands()
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_main_job_command_runs_the_demo():
    result = subprocess.run(
        ["bash", "-c", setup_commands()[0]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "stopped; 3 of 3 workers succeeded"
    assert sum(" running  127.0.0.1" in line for line in lines) == 3
    assert sum(" succeeded  127.0.0.1   0" in line for line in lines) == 3
    assert sum(re.match(r"\[\w+-\d\] worker \w+-\d on .* computed \d+", line) is not None for line in lines) == 3
