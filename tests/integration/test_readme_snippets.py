"""The README's python blocks run as copied: in one real kernel started in the repository's root, each
block a cell, top to bottom (tests/harness/readme_blocks.py reads them; blocks marked as excerpts are left out).

A block fails the test when its cell raises, and also when a run or a worker it started failed without
raising (a `%horovod` whose rank exited 1 returns a result; an await_workers lists failures): the kernel
records every failed run, failed worker and failed launch of every session. Afterwards
`cmlcluster.stop_session()` leaves nothing of the kernel's sessions running, and neither does the
kernel's shutdown.
"""

from __future__ import annotations

import json
import re

import pytest
from harness import readme_blocks
from harness.kernels import running_kernel
from harness.processes import alive_after, cmlcluster_processes

from cmlcluster import records

pytestmark = pytest.mark.integration

ANSI = re.compile(r"\x1b\[[0-9;]*m")
BLOCK_SECONDS = 300  # one block's limit; the whole README takes about 90 s on 2 idle cores

# The kernel's own recorder, before any README block: every session's events pass EventBus.publish,
# the default session's and those a run or a backend= makes alike, including sessions that
# stop_session() replaced.
RECORD_FAILURES = """
import cmlcluster.events as _events

_readme_failures = []
_readme_publish = _events.EventBus.publish


def _readme_record(bus, event):
    if isinstance(event, _events.RunEnded) and not event.ok:
        _readme_failures.append(f"run {event.run} failed: {event.message}")
    elif isinstance(event, _events.WorkerStatus) and event.worker.status == "failed":
        _readme_failures.append(f"worker {event.worker.id} failed: exit code {event.worker.exit_code}")
    elif isinstance(event, _events.LaunchFailed):
        _readme_failures.append(f"a launch failed: {event.message}")
    return _readme_publish(bus, event)


_events.EventBus.publish = _readme_record
"""
TAKE_FAILURES = "import json as _json\nprint(_json.dumps(_readme_failures))\n_readme_failures.clear()"


def execute(kc, code: str) -> tuple[dict, str]:
    """Run a cell; its reply and what it printed (streams, results, the traceback of an error)."""
    out: list[str] = []

    def hook(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            out.append(ANSI.sub("", "\n".join(content["traceback"])))

    reply = kc.execute_interactive(code, output_hook=hook, timeout=BLOCK_SECONDS)
    return reply["content"], "".join(out)


def failures_since(kc) -> list[str]:
    reply, out = execute(kc, TAKE_FAILURES)
    assert reply["status"] == "ok", out
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def outputs_kept():
    """The README's collect= block writes outputs/<worker id>.txt in the repository's root: the files it
    made there go afterwards (and the folder, if it made that), whatever was there before stays."""
    folder = readme_blocks.ROOT / "outputs"
    existed = folder.exists()
    before = set(folder.rglob("*")) if existed else set()
    yield
    for path in sorted(set(folder.rglob("*")) - before, reverse=True):  # files before their folders
        path.rmdir() if path.is_dir() else path.unlink()
    if not existed and folder.exists():
        folder.rmdir()


@pytest.mark.timeout(900)
def test_readme_python_blocks_run_as_copied_and_leave_nothing_running(tmp_path, monkeypatch, outputs_kept):
    # Session records in a folder of this test's own, to see that every session closed.
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))
    blocks = readme_blocks.runnable()
    assert len(blocks) >= 5, f"only {len(blocks)} runnable python blocks in README.md"
    with running_kernel(cwd=str(readme_blocks.ROOT)) as (km, kc):
        reply, out = execute(kc, RECORD_FAILURES)
        assert reply["status"] == "ok", out
        for block in blocks:
            where = f"README.md line {block.line}"
            try:
                reply, out = execute(kc, block.code)
            except TimeoutError:
                pytest.fail(f"{where}: still running after {BLOCK_SECONDS} s")
            assert reply["status"] == "ok", f"{where}: {reply.get('ename')}: {reply.get('evalue')}\n{out[-4000:]}"
            failed = failures_since(kc)
            assert not failed, f"{where}: " + "\n".join(failed) + f"\n{out[-4000:]}"

        started = [p.pid for p in cmlcluster_processes()]
        assert started, "the README's blocks left no controller to stop: is the session already gone?"
        reply, out = execute(kc, "import cmlcluster\ncmlcluster.stop_session()")
        assert reply["status"] == "ok", out
        left = alive_after(started, within=15)
        assert not left, f"running after cmlcluster.stop_session(): {left}"
        assert records.records() == [], "a session's record is still there after stop_session()"
        kernel = km.provisioner.pid
        km.shutdown_kernel(now=False)
    assert alive_after([kernel], within=15) == []
    assert cmlcluster_processes() == [], "processes of the kernel's sessions outlived it"
