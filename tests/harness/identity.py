"""The run: its tag and its folders, set at import (tests/conftest.py imports this first), before any test
module or session reads them; subprocesses (kernels, the CLI) inherit them.

A run owns only what it starts. It has a tag (CMLCLUSTER_RUN_TAG, which every container of its sessions
and test hosts carries as a label), a state folder for session records (CMLCLUSTER_STATE_DIR: `cmlcluster
list` on this machine never shows the run's sessions) and a temp folder (TMPDIR) of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import uuid

from cmlcluster.backends.base import RUN_TAG_ENV

# A run is this pytest process and, with pytest-xdist (`-n 2` in pyproject.toml), its workers. The first
# process, the root, makes the run's folder and tag; each worker gets a tag of its own below the root's
# ("<root tag>-gw0"), so that its leak checks see only what it started and the root's last sweep sees all.
ROOT_ENV = "CMLCLUSTER_TESTS_ROOT"  # the root's folder, for every process of the run
IS_ROOT = ROOT_ENV not in os.environ
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "" in the root
# Set at import, before any test module or session reads them; subprocesses (kernels, the CLI) inherit them.
RUN_TAG = f"tests-{uuid.uuid4().hex[:12]}" if IS_ROOT else f"{os.environ[RUN_TAG_ENV]}-{WORKER or os.getpid()}"
# Not named cmlcluster-*: what the run's programs write under its temp folder on an SSH host (a script's
# checkpoints, say) is theirs, not a session folder that a leak check looks for.
# A worker's folder lies beside the root's, not in it: chromium's socket path (at most 107 bytes) is in it.
RUN_DIR = tempfile.mkdtemp(prefix=f"{RUN_TAG}-", dir=None if IS_ROOT else os.path.dirname(os.environ[ROOT_ENV]))
# Also when the run never reaches its end (a usage error after this import: no pytest_sessionfinish).
atexit.register(shutil.rmtree, RUN_DIR, True)
ROOT_DIR = RUN_DIR if IS_ROOT else os.environ[ROOT_ENV]
os.environ[ROOT_ENV] = ROOT_DIR
os.environ[RUN_TAG_ENV] = RUN_TAG
os.environ["CMLCLUSTER_STATE_DIR"] = os.path.join(RUN_DIR, "state")
os.environ["TMPDIR"] = os.path.join(RUN_DIR, "tmp")
os.makedirs(os.environ["TMPDIR"])
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

# What every process of the run shares, in the root's folder: what the leak checks reported and the
# tests that finished (one JSON line each, appended), and the bystander (tests/harness/bystander.py).
REPORTS = os.path.join(ROOT_DIR, "reported.jsonl")
FINISHED = os.path.join(ROOT_DIR, "finished.jsonl")
BYSTANDER = os.path.join(ROOT_DIR, "bystander.json")


def append_line(path: str, record) -> None:
    """One JSON line, appended in one write: processes of the run append to the same file at once."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_lines(path: str) -> list:
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        return [json.loads(line) for line in f]
    return []
