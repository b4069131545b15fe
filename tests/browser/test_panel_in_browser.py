"""The JupyterLab panel (cmlcluster/lab, labextension/) as a user sees it, in headless Chromium: a notebook's
real local workers shown live with their notebook, stopped one by one and all at once from the panel (their
processes really end, and the session's own record and the kernel's list_workers say stopped), the session
still there after a page reload, kept with its outcome and logs after a kernel restart closed it, and a
killed session's leftovers cleaned up from the panel. Screenshots: test-artifacts/panel-*.png."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from harness.processes import wait_until

from browser.jupyterlab import NotebookPage, jupyter_lab, open_notebook, write_notebook
from cmlcluster import origin, records

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]

PANEL = ".cmlcluster-lab-panel"
PANEL_TAB = '.jp-SideBar .lm-TabBar-tab[data-id="cmlcluster-lab-panel"]'
SLEEPER = "import time; print('sleeper up', flush=True); time.sleep(600)"

LAUNCH = f"""\
import cmlcluster as cdsw
sleepers = cdsw.launch_workers(2, cpu=0.5, memory=0.5, code={SLEEPER!r})
# Its agent samples nothing (CMLCLUSTER_USAGE_SECONDS=0): the test sends a sample of its own for it.
unsampled = cdsw.launch_workers(1, cpu=0.5, memory=0.5, code={SLEEPER!r}, env={{"CMLCLUSTER_USAGE_SECONDS": "0"}})
quick = cdsw.launch_workers(1, cpu=0.5, memory=0.5, code="print('the quick worker is done', flush=True)")
cdsw.await_workers(sleepers + unsampled, wait_for_completion=False, timeout_seconds=120)
cdsw.await_workers(quick, wait_for_completion=True, timeout_seconds=120)
"""

# Code run in the notebook's kernel, as a cell would run it; its stdout comes back.
EXECUTE_JS = """
async ([path, code]) => {
  const app = window.jupyterapp;
  const panel = Array.from(app.shell.widgets('main')).find((w) => w.context && w.context.path === path);
  const future = panel.sessionContext.session.kernel.requestExecute({code, store_history: false});
  let out = '';
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream') out += msg.content.text;
    if (msg.header.msg_type === 'error') out += `ERROR ${msg.content.ename}: ${msg.content.evalue}`;
  };
  await future.done;
  return out;
}
"""

RESTART_JS = """
async (path) => {
  const app = window.jupyterapp;
  const panel = Array.from(app.shell.widgets('main')).find((w) => w.context && w.context.path === path);
  await panel.sessionContext.session.kernel.restart();
}
"""


def private_state(tmp_path: Path, monkeypatch) -> Path:
    """A state folder of the test's, for the server, its kernels and this process alike."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(state))
    return state


def open_panel(nb: NotebookPage, width: int = 560) -> None:
    """Click the panel's icon in the left sidebar, as a user opens it; then drag the sidebar's edge to
    `width` pixels, as a user makes room for the workers' table (and the screenshots show all of it)."""
    nb.page.locator(PANEL_TAB).click()
    nb.page.locator(PANEL).wait_for(state="visible", timeout=30_000)
    edge = nb.page.locator("#jp-main-split-panel > .lm-SplitPanel-handle").first.bounding_box()
    assert edge is not None
    y = edge["y"] + edge["height"] / 2
    nb.page.mouse.move(edge["x"] + edge["width"] / 2, y)
    nb.page.mouse.down()
    nb.page.mouse.move(width, y, steps=5)
    nb.page.mouse.up()


def session_box(nb: NotebookPage, session_id: str, state: str):
    return nb.page.locator(f'{PANEL} [data-session="{session_id}"][data-state="{state}"]')


def wait_for_rows(nb: NotebookPage, session_id: str, statuses: dict[str, str], timeout: float = 30) -> None:
    """Until the panel's rows of that live session show these statuses (worker id -> status)."""
    deadline = time.monotonic() + timeout
    shown: dict[str, str] = {}
    while time.monotonic() < deadline:
        rows = session_box(nb, session_id, "alive").locator("tr[data-worker]")
        shown = {
            rows.nth(i).get_attribute("data-worker"): rows.nth(i).get_attribute("data-status")
            for i in range(rows.count())
        }
        if shown == statuses:
            return
        nb.page.wait_for_timeout(250)
    raise AssertionError(f"the panel shows {shown}, not {statuses}")


def widget_status(nb: NotebookPage, worker_id: str) -> str | None:
    """The status the session's own widget (in the notebook) shows for the worker."""
    return nb.page.evaluate(
        "(id) => { const row = document.querySelector("
        "`.jp-NotebookPanel table.cmlcluster-workers tr[data-worker='${id}']`);"
        " return row ? row.dataset.status : null; }",
        worker_id,
    )


def in_kernel(nb: NotebookPage, code: str) -> str:
    return nb.page.evaluate(EXECUTE_JS, [nb.notebook, code])


def kernel_statuses(nb: NotebookPage) -> dict[str, str]:
    out = in_kernel(nb, "import json; print(json.dumps({w['id']: w['status'] for w in cdsw.list_workers()}))")
    return json.loads(out)


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait(condition, what: str, timeout: float = 30):
    return wait_until(condition, timeout, what)


def the_record() -> dict:
    [record] = records.records()
    return record


def test_the_panel_shows_stops_and_keeps_a_notebooks_session(tmp_path, monkeypatch):
    state = private_state(tmp_path, monkeypatch)
    write_notebook(tmp_path, "train.ipynb", [LAUNCH])
    env = {"CMLCLUSTER_STATE_DIR": str(state)}
    with jupyter_lab(tmp_path, env=env) as lab, open_notebook(lab, "train.ipynb", artifact_name="panel") as nb:
        nb.run_all(timeout=240)
        assert nb.cell_errors() == []
        record = the_record()
        session_id = record["id"]
        pids = {w["id"]: w["pid"] for w in record["workers"]}
        sleepers, quick = sorted(pids)[:3], sorted(pids)[3]

        open_panel(nb)
        wait_for_rows(nb, session_id, {**dict.fromkeys(sleepers, "running"), quick: "succeeded"})
        box = session_box(nb, session_id, "alive")
        assert box.locator(".cmlcluster-lab-notebook").inner_text() == "train.ipynb"
        assert "local" in box.locator(".cmlcluster-lab-heading").inner_text()

        # Each worker's agent samples what it uses (cmlcluster/usage.py): CPU %, and memory against the
        # limit of its cgroup (0.5 GB asked: 512 MiB).
        sampling = box.locator(f'tr[data-worker="{sleepers[0]}"]')
        # In the widget's words (ui/model.resource_texts): what it asked for · what it uses.
        cpu = sampling.locator(".cmlcluster-lab-cpu")
        wait(lambda: re.fullmatch(r"0\.5 · \d+ %", cpu.inner_text()), "a CPU sample")
        assert re.fullmatch(r"0\.\d+ / 0\.5 GiB", sampling.locator(".cmlcluster-lab-memory").inner_text())
        nb.screenshot("live")  # real samples only (the README shows it)
        # A sample with a GPU, as an agent with NVML sends it (no GPU here: the values are made up, the way
        # is real: an event of the session, its record, the REST API, the row), for the worker that sends
        # none of its own, which would replace it.
        sampled = sleepers[2]
        in_kernel(
            nb,
            "from cmlcluster.events import GpuUse, ResourceUse\n"
            f"cdsw.get_session().publish(ResourceUse({sampled!r}, 37.6, 200 << 20, 512 << 20,"
            " (GpuUse(0, 71.0, 2 << 30, 16 << 30),)))",
        )
        row = box.locator(f'tr[data-worker="{sampled}"]')
        wait(lambda: row.locator(".cmlcluster-lab-cpu").inner_text() == "0.5 · 38 %", "the sample's CPU in the row")
        assert row.locator(".cmlcluster-lab-memory").inner_text() == "0.2 / 0.5 GiB"
        assert row.locator(".cmlcluster-lab-gpu").inner_text() == "1 · 71 % · 2 / 16 GiB"
        nb.screenshot("live-made-up-gpu-sample")

        # Stop one worker: its process ends, and the session (record, kernel, its widget) says stopped.
        first = sleepers[0]
        box.locator(f'tr[data-worker="{first}"]').get_by_role("button", name="Stop").click()
        wait(lambda: ended(pids[first]), "the stopped worker's process to end")
        wait_for_rows(
            nb, session_id, {first: "stopped", sleepers[1]: "running", sleepers[2]: "running", quick: "succeeded"}
        )
        assert {w["id"]: w["status"] for w in the_record()["workers"]}[first] == "stopped"
        assert kernel_statuses(nb) == {
            first: "stopped",
            sleepers[1]: "running",
            sleepers[2]: "running",
            quick: "succeeded",
        }
        wait(lambda: widget_status(nb, first) == "stopped", "the notebook's widget to show the worker stopped")
        assert not ended(pids[sleepers[1]]) and not ended(pids[sleepers[2]])

        # Stop all: the rest end.
        box.get_by_role("button", name="Stop all").click()
        wait(lambda: all(ended(pids[w]) for w in sleepers), "every worker's process to end")
        wait_for_rows(nb, session_id, {**dict.fromkeys(sleepers, "stopped"), quick: "succeeded"})
        assert kernel_statuses(nb) == {**dict.fromkeys(sleepers, "stopped"), quick: "succeeded"}

        # A live log view: the quick worker's log, read from the kept-logs folder.
        box.locator(f'tr[data-worker="{quick}"]').get_by_role("button", name="log").click()
        assert "the quick worker is done" in box.locator(".cmlcluster-lab-log pre").inner_text()
        nb.screenshot("stopped")

        # A page reload: the panel opens again as it was, and shows the session.
        nb.page.reload(wait_until="domcontentloaded")
        nb.wait_until_idle(90)
        nb.page.locator(PANEL).wait_for(state="visible", timeout=30_000)
        wait_for_rows(nb, session_id, {**dict.fromkeys(sleepers, "stopped"), quick: "succeeded"})

        # One more worker running, then a kernel restart: it closes the session, which ends the worker.
        [late] = json.loads(
            in_kernel(
                nb,
                f"import json; launched = cdsw.launch_workers(1, cpu=0.5, memory=0.5, code={SLEEPER!r});"
                " print(json.dumps([w['id'] for w in launched]))",
            )
        )
        wait_for_rows(
            nb, session_id, {**dict.fromkeys(sleepers, "stopped"), quick: "succeeded", late: "running"}, timeout=60
        )
        late_pid = {w["id"]: w["pid"] for w in the_record()["workers"]}[late]
        nb.page.evaluate(RESTART_JS, nb.notebook)
        wait(lambda: ended(late_pid), "the restart to end the running worker")
        wait(lambda: records.records() == [], "the session's record to go as it closes")
        kept = session_box(nb, session_id, "closed")
        kept.wait_for(timeout=30_000)
        assert session_box(nb, session_id, "alive").count() == 0
        assert kept.locator(".cmlcluster-lab-notebook").inner_text() == "train.ipynb"
        outcome = kept.locator(".cmlcluster-lab-outcome").inner_text()
        assert outcome.startswith("1 succeeded, 4 stopped · ended "), outcome
        assert " s" in kept.locator(".cmlcluster-lab-details").inner_text()  # its duration
        kept.locator(f'[data-worker="{first}"]').get_by_role("button", name="log").click()
        assert "sleeper up" in kept.locator(".cmlcluster-lab-log pre").inner_text()
        nb.wait_until_idle(90)
        nb.screenshot("kept")
        assert nb.errors() == []


GONE_SESSION = textwrap.dedent(f"""
    import json, time
    from cmlcluster import Session
    # Its worker is frozen before the session dies (below): it hears neither its lifeline nor the silence,
    # outlives the session, as a hung worker would, and is left for cleanup.
    s = Session("local", echo=False, silence_timeout=600)
    [w] = s.launch_workers(1, cpu=0.5, memory=0.5, code={SLEEPER!r})
    s.await_workers([w], wait_for_completion=False, timeout_seconds=60)
    s.drain(5)  # its record names the worker's pid
    print(json.dumps({{"session": s.id, "worker": w["id"], "pid": s.worker_pid(w)}}), flush=True)
    time.sleep(3600)
""")


def test_clean_up_in_the_panel_ends_what_a_killed_session_left(tmp_path, monkeypatch):
    state = private_state(tmp_path, monkeypatch)
    write_notebook(tmp_path, "empty.ipynb", ["1 + 1"])
    env = {"CMLCLUSTER_STATE_DIR": str(state)}
    session = subprocess.Popen([sys.executable, "-c", GONE_SESSION], stdout=subprocess.PIPE, text=True)
    try:
        assert session.stdout is not None
        ids = json.loads(session.stdout.readline())
        os.kill(ids["pid"], signal.SIGSTOP)
    finally:
        session.send_signal(signal.SIGKILL)  # a kernel that died: its record and its frozen worker stay
        session.wait()
    try:
        with jupyter_lab(tmp_path, env=env) as lab, open_notebook(lab, "empty.ipynb", artifact_name="panel") as nb:
            open_panel(nb)
            gone = session_box(nb, ids["session"], "gone")
            gone.wait_for(timeout=60_000)  # once its controller's lifeline has ended the controller
            assert not ended(ids["pid"])
            assert "w0 running when last recorded" in gone.inner_text()
            nb.screenshot("gone")
            nb.page.locator(f"{PANEL} button.cmlcluster-lab-cleanup").click()
            gone.wait_for(state="detached", timeout=30_000)
            wait(lambda: ended(ids["pid"]), "cleanup to end the gone session's worker")
            assert [r for r in records.records() if r["id"] == ids["session"]] == []
            said = nb.page.locator(".cmlcluster-lab-notice").inner_text()  # as `cmlcluster cleanup` says it
            assert re.search(
                rf"session {ids['session']} \(pid \d+ is gone\): ended worker {ids['worker']} \(pid {ids['pid']}\)",
                said,
            ), said
            # Its logs are kept: listed as a session that died, with its worker's last known status.
            died = session_box(nb, ids["session"], "died")
            died.wait_for(timeout=30_000)
            assert "running" in died.locator(f'[data-worker="{ids["worker"]}"]').inner_text()
            nb.screenshot("cleanup")
            assert nb.errors() == []
    finally:
        if not ended(ids["pid"]):  # the test failed before cleanup ended it
            os.killpg(ids["pid"], signal.SIGKILL)
        for record in records.records():
            if record["state"] == origin.GONE:
                records.clean(record)
