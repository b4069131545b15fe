"""The views against real local workers, in a real kernel and in a real terminal, and the CLI."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import psutil
import pytest
from harness.kernels import running_kernel
from harness.processes import own_tree

from cmlcluster import Session, origin
from cmlcluster.ui.widget import RENDER_HZ, WidgetView

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).with_name("cmlcluster"))

REPORTING = """
import time, cmlcluster
for step in range(1, 21):
    cmlcluster.report(step, 20, loss=10.0 / step)
    time.sleep(0.05)
print("trained")
"""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for init to reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def statuses(view: WidgetView) -> dict[str, str]:
    return dict(re.findall(r'data-worker="([^"]+)" data-status="([^"]+)"', view.table.value))


def eventually(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert check()


def test_widget_follows_real_workers_and_draws_their_reports():
    with Session("local", echo=False) as s:
        view = WidgetView(s)
        workers = s.launch_workers(2, cpu=0.5, memory=0.5, code=REPORTING)
        result = s.await_workers(workers, timeout_seconds=60)
        assert result["failures"] == []
        eventually(lambda: set(statuses(view).values()) == {"succeeded"})
        assert view.up.value == 2
        for w in workers:
            eventually(lambda w=w: len(view.lines.get(w["id"], ()).y if w["id"] in view.lines else ()) == 20)
            assert view.lines[w["id"]].y[-1] == pytest.approx(0.5)
            assert view.task_bars[w["id"]].value == 20
        assert "trained" in view.output.value
        assert "@cmlcluster-progress" not in view.output.value  # reports are not output


def test_widget_updates_stay_capped_while_a_real_worker_prints_100000_lines():
    with Session("local", echo=False) as s:
        view = WidgetView(s)
        before, started = view.updates, time.monotonic()
        [w] = s.launch_workers(1, cpu=1, memory=1, code="for i in range(100_000): print('line', i)")
        assert s.await_workers([w], timeout_seconds=120)["failures"] == []
        eventually(lambda: "line 99999" in view.output.value, timeout=30)
        elapsed = time.monotonic() - started
        updates = view.updates - before
        # At once, then at most one render per 1/RENDER_HZ s: a bound the render loop keeps, however fast.
        assert updates <= 1 + elapsed * RENDER_HZ, f"{updates} updates in {elapsed:.1f} s"


def test_stop_button_ends_real_worker_processes():
    with Session("local", echo=False) as s:
        view = WidgetView(s)
        idle = s.launch_workers(2, cpu=0.5, memory=0.5)
        s.await_workers(idle, wait_for_completion=False, timeout_seconds=60)
        pids = [s.worker_pid(w) for w in idle]
        assert all(alive(p) for p in pids)
        view.stop_button.click()
        eventually(lambda: set(statuses(view).values()) == {"stopped"}, timeout=15)
        eventually(lambda: not any(alive(p) for p in pids))


def run_in_terminal(code: str, env: dict[str, str], timeout: float = 120) -> str:
    """Run `python -c code` on a pseudo-terminal (its stdout and stderr are a tty); return what it wrote."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal program, 120 columns wide (a new pty has none)
        try:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
            os.chdir(ROOT)
            os.execve(sys.executable, [sys.executable, "-c", code], env)
        finally:
            os._exit(127)  # never back into pytest in a forked child
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    text = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    return text


TERMINAL_RUN = f"""
import cmlcluster
with cmlcluster.Session("local") as s:
    ws = s.launch_workers(2, cpu=0.5, memory=0.5, code={REPORTING!r})
    assert not s.await_workers(ws, timeout_seconds=60)["failures"]
"""


def test_a_terminal_shows_tqdm_bars_and_the_output():
    text = run_in_terminal(TERMINAL_RUN, dict(os.environ))
    assert re.search(r"workers up: +\d+%\|", text), text  # tqdm's bar while workers come up
    assert re.search(r"w[01]: 100%\|[^\r\n]*\| 20/20 [^\r\n]*loss=0\.5", text), text  # a bar per task
    assert "] trained" in text


def test_without_a_terminal_the_same_run_prints_text(tmp_path):
    result = subprocess.run([sys.executable, "-c", TERMINAL_RUN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "%|" not in result.stdout + result.stderr  # no bars into a pipe
    # The workers' output on stdout; cmlcluster's own lines on stderr.
    assert len(re.findall(r"^\[w[01]\] trained$", result.stdout, re.M)) == 2, result.stdout
    assert len(re.findall(r"^\[w[01]\] running on ", result.stderr, re.M)) == 2, result.stderr
    assert len(re.findall(r"^\[w[01]\] step 20/20 loss=0.5$", result.stderr, re.M)) == 2
    assert len(re.findall(r"^\[w[01]\] succeeded$", result.stderr, re.M)) == 2


@pytest.fixture
def kernel():
    with running_kernel(cwd=str(ROOT)) as (_, kc):
        yield kc


WIDGET = "application/vnd.jupyter.widget-view+json"


def execute(kc, code: str) -> list[dict]:
    outputs: list[dict] = []

    def hook(msg):
        if msg["msg_type"] in ("stream", "display_data", "error", "execute_result"):
            outputs.append({"type": msg["msg_type"], **msg["content"]})

    reply = kc.execute_interactive(code, output_hook=hook, timeout=120)
    errors = [o for o in outputs if o["type"] == "error"]
    assert reply["content"]["status"] == "ok", errors
    return outputs


def text_of(outputs: list[dict]) -> str:
    return "".join(o.get("text", "") for o in outputs if o["type"] == "stream")


LAUNCH_AND_WAIT = f"""
import cmlcluster as cdsw
ws = cdsw.launch_workers(2, cpu=0.5, memory=0.5, code={REPORTING!r})
result = cdsw.await_workers(ws, timeout_seconds=60)
assert not result["failures"], result
"""


def test_in_a_kernel_each_call_shows_a_view_of_its_own_and_the_whole_session_on_request(kernel):
    cell = f"""
import cmlcluster as cdsw
ws = cdsw.launch_workers(2, cpu=0.5, memory=0.5, code={REPORTING!r})
one = cdsw.launch_workers(1, cpu=0.5, memory=0.5, code='pass')
assert not cdsw.await_workers(ws, timeout_seconds=60)["failures"]
assert not cdsw.await_workers(one, timeout_seconds=60)["failures"]
"""
    outputs = execute(kernel, cell)
    shown = [o["data"][WIDGET]["model_id"] for o in outputs if WIDGET in o.get("data", {})]
    # Each launch: a view; each await_workers of one launch's workers in its cell joins that launch's view.
    assert len(shown) == 2 and len(set(shown)) == 2
    assert text_of(outputs) == ""  # output and progress are in the widgets, not printed
    state = execute(
        kernel,
        "import json, re\nfrom cmlcluster.ui.attached import view_of\nviews = view_of(cdsw.get_session())\n"
        "cdsw.await_workers(cdsw.list_workers(), timeout_seconds=60)\nimport time; time.sleep(1)\n"
        "rows = lambda v: re.findall(r'data-status=\"(\\w+)\"', v.table.value)\n"
        "print(json.dumps({'rows': [rows(v) for v in views.views], 'models': [v.widget.model_id for v in views.views],"
        " 'curves': {t: len(l.y) for t, l in views.views[0].lines.items()}, 'labels': views.views[0].source.options}))",
    )
    seen = json.loads(text_of(state))
    assert seen["models"][:2] == shown
    # The first call's two workers, the second's one, and the later cell's await: all three it waited for.
    assert seen["rows"] == [["succeeded"] * 2, ["succeeded"], ["succeeded"] * 3]
    assert sorted(seen["curves"].values()) == [20, 20]  # the first call's workers reported: its curves
    assert [label for label, _ in seen["labels"]] == ["w0", "w1"]
    again = execute(kernel, "cdsw.get_session()")  # the whole session's view, on request
    [whole] = [o["data"][WIDGET]["model_id"] for o in again if "data" in o]
    assert whole not in seen["models"]
    rows = execute(kernel, "print(rows(views.whole_view))")
    assert text_of(rows).strip() == str(["succeeded"] * 3)
    execute(kernel, "cdsw.stop_session()")


def test_in_a_kernel_without_ipywidgets_the_same_run_prints_text(kernel):
    execute(kernel, "import sys\nsys.modules['ipywidgets'] = None  # unimportable, as when not installed")
    outputs = execute(kernel, LAUNCH_AND_WAIT)
    assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    text = text_of(outputs)
    assert len(re.findall(r"^\[w[01]\] running on ", text, re.M)) == 2, text
    assert len(re.findall(r"^\[w[01]\] step 20/20 loss=0.5$", text, re.M)) == 2, text
    assert len(re.findall(r"^\[w[01]\] trained$", text, re.M)) == 2, text
    execute(kernel, "cdsw.stop_session()")


SESSION_THAT_WAITS = """
import sys, time, cmlcluster
s = cmlcluster.Session("local", echo=False)
ws = s.launch_workers(2, cpu=0.5, memory=0.5)
s.await_workers(ws, wait_for_completion=False, timeout_seconds=60)
print(s.id, *[s.worker_pid(w) for w in ws], flush=True)
time.sleep(600)
"""


def test_cli_list_sees_another_process_session_and_cleanup_ends_what_a_killed_one_left(tmp_path):
    env = {**os.environ, "CMLCLUSTER_STATE_DIR": str(tmp_path / "state")}
    other = subprocess.Popen([sys.executable, "-c", SESSION_THAT_WAITS], env=env, stdout=subprocess.PIPE, text=True)
    try:
        session_id, *pids = other.stdout.readline().split()
        listed = subprocess.run([CLI, "list"], env=env, capture_output=True, text=True, check=True).stdout
        assert re.search(rf"^session {session_id}  pid {other.pid}  local  up \d+ s$", listed, re.M), listed
        assert len(re.findall(rf"^  w[01] +{session_id}-[01] +running +127\.0\.0\.1 ", listed, re.M)) == 2, listed
        # The record says which process the session is and where its controller listens (cleanup asks it).
        record = json.loads((tmp_path / "state" / f"{session_id}.json").read_text())
        assert record["origin"]["pid"] == str(other.pid) and origin.answers(record["controller"]), record
        # Frozen workers (a hung agent hears no lifeline) outlive their session's death: what cleanup is for,
        # now that a killed session's local workers end by themselves (test_workers).
        for pid in pids:
            os.kill(int(pid), signal.SIGSTOP)
        other.kill()  # as a killed kernel would be: no close(), nothing stopped
        other.wait()
        # Gone once its controller has followed it (its lifeline ends it at once): until then it answers.
        eventually(lambda: not origin.answers(record["controller"]), timeout=10)
        listed = subprocess.run([CLI, "list"], env=env, capture_output=True, text=True, check=True).stdout
        assert "its process is gone" in listed
        cleaned = subprocess.run([CLI, "cleanup"], env=env, capture_output=True, text=True, check=True).stdout
        assert f"session {session_id} (pid {other.pid} is gone): ended worker {session_id}-" in cleaned, cleaned
        eventually(lambda: not any(alive(int(p)) for p in pids), timeout=5)
        # Its record is gone; its workers' logs are kept (`cmlcluster logs`), under logs/ only.
        assert os.listdir(tmp_path / "state") == ["logs"] and os.listdir(tmp_path / "state" / "logs") == [session_id]
        listed = subprocess.run([CLI, "list"], env=env, capture_output=True, text=True, check=True).stdout
        assert listed.strip() == "no cmlcluster sessions on this machine"
    finally:
        other.kill()
        # Its workers, if cleanup failed: orphans of this process (conftest makes it their subreaper), found
        # in its tree, never by a number that another process may hold since.
        left = {int(p) for p in pids} if "pids" in dir() else set()
        for process in own_tree():
            if process.pid in left:
                with contextlib.suppress(psutil.Error):
                    process.kill()


def test_cli_help_names_every_command():
    text = subprocess.run([CLI, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("demo", "run-cluster", "horovod", "list", "cleanup"):
        assert re.search(rf"^    {command}\b", text, re.M), text
        sub = subprocess.run([CLI, command, "--help"], capture_output=True, text=True, check=True).stdout
        assert sub.startswith(f"usage: cmlcluster {command}")


def test_cli_horovod_runs_ranks_with_their_output_and_progress():
    script = ROOT / "worker_scripts" / "horovod_keras_train.py"
    result = subprocess.run(
        [CLI, "horovod", "-np", "2", "--cpu", "0.5", str(script), "--epochs", "2", "--steps-per-epoch", "5"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] rank {rank}: loss [\d.]+ -> [\d.]+$", result.stdout, re.M), result.stdout
        assert re.search(rf"^\[rank {rank}\] step 10/10 loss=", result.stderr, re.M), result.stderr
    assert "@cmlcluster-progress" not in result.stdout + result.stderr


def test_cli_run_cluster_runs_clouderas_worker_script(tmp_path):
    result = subprocess.run(
        [
            CLI,
            "run-cluster",
            "--workers",
            "2",
            "--ps",
            "1",
            "--cpu",
            "0.5",
            str(ROOT / "worker_scripts" / "tf_ps_train.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "TRAIN_STEPS": "60"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^\[worker 0\] worker 0: done, \d+ steps, final loss [\d.]+$", result.stdout, re.M), result.stdout
    assert result.stdout.splitlines()[-1] == "2 of 2 worker tasks succeeded"
