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
    # The workers' table, while training and after: a parameter server and two workers.
    running = [line for line in lines if re.match(r"(ps 0|worker [01]) +\w+-\d +running +127\.0\.0\.1:\d+", line)]
    stopped = [line for line in lines if re.match(r"(ps 0|worker [01]) +\w+-\d +stopped +127\.0\.0\.1:\d+", line)]
    assert len(running) == 3 and len(stopped) == 3, result.stdout
    # Progress from the coordinator's Keras callback, and the loss going down epoch by epoch.
    assert re.search(r"^\[coordinator\] step 150/150 loss=", result.stderr, re.M), result.stderr
    [epochs] = [line for line in lines if line.startswith("loss by epoch: ")]
    losses = [float(x) for x in epochs.split(": ")[1].split()]
    assert len(losses) == 15 and losses[-1] < losses[0] / 5, losses
    assert re.fullmatch(r"stopped; 15 epochs on 2 workers, loss [\d.]+ -> [\d.]+", lines[-1]), lines[-1]
