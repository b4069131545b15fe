"""The session widget as a user sees it: the notebooks run in JupyterLab, in headless Chromium."""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from browser.jupyterlab import jupyter_lab, open_notebook, write_notebook

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]

# Records every status each worker row shows, as the widget redraws its table.
RECORD_STATUSES = """() => {
  window.cmlclusterStatuses = {};
  const record = () => document.querySelectorAll("table.cmlcluster-workers tr[data-worker]").forEach(row => {
    const seen = (window.cmlclusterStatuses[row.dataset.worker] ||= []);
    if (seen[seen.length - 1] !== row.dataset.status) seen.push(row.dataset.status);
  });
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, attributes: true});
}"""


TWO_STOPPED = "() => Object.values(window.cmlclusterStatuses).filter(s => s[s.length - 1] === 'stopped').length >= 2"


def copy_notebook(name: str, folder: Path) -> None:
    shutil.copy(ROOT / "notebooks" / name, folder / name)


def test_worker_api_notebook_shows_rows_going_from_running_to_succeeded(tmp_path):
    copy_notebook("worker_api.ipynb", tmp_path)
    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "worker_api.ipynb", artifact_name="worker_api") as nb:
        nb.page.evaluate(RECORD_STATUSES)
        nb.run_all(timeout=300)
        # The last cell's stop reaches the page as the view's next render, which may come after the cell ends.
        with contextlib.suppress(PlaywrightTimeout):
            nb.page.wait_for_function(TWO_STOPPED, timeout=15_000)
        seen = nb.page.evaluate("() => window.cmlclusterStatuses")
        finished = {worker: statuses for worker, statuses in seen.items() if "succeeded" in statuses}
        assert len(finished) == 2, seen  # the two workers with a program
        for statuses in finished.values():
            assert statuses.index("running") < statuses.index("succeeded"), seen
        stopped = [worker for worker, statuses in seen.items() if statuses[-1] == "stopped"]
        assert len(stopped) == 2, seen  # the idle ones, stopped by the last cell
        assert nb.page.locator(".cmlcluster-session").count() == 2  # once per launching cell
        # The selected worker's log: none in the page (nor in the saved notebook) until "show log" reads its end.
        first = nb.page.locator(".cmlcluster-session").first
        tail = first.locator("pre.cmlcluster-log-tail")
        assert tail.count() == 0
        first.get_by_role("button", name="show log").click()
        tail.wait_for(timeout=30_000)
        assert re.search(r"[0-9a-f]{16}-\d+\.log, the whole log", first.locator("div.cmlcluster-log-tail").inner_text())
        text = tail.inner_text()
        assert [line for line in text.splitlines() if line.startswith("step ")][-1].startswith("step 2 on "), text
        first.get_by_role("button", name="hide log").click()
        tail.wait_for(state="detached", timeout=30_000)
        nb.screenshot("done")
        assert nb.errors() == []


def test_parameter_server_notebook_trains_stops_and_draws_the_loss_curve(tmp_path):
    """The notebook as JupyterLab runs it, its own folder the kernel's: what each cell prints, and the
    view's loss curve. (Run here only, not again by nbclient in test_notebooks.py.)"""
    copy_notebook("tensorflow_parameter_server.ipynb", tmp_path)
    with (
        jupyter_lab(tmp_path) as lab,
        open_notebook(lab, "tensorflow_parameter_server.ipynb", artifact_name="parameter_server") as nb,
    ):
        nb.run_all(timeout=400)
        spec, training, weights, stopped = (nb.stdout(i) for i in (3, 5, 7, 9))
        assert re.search(r"^ps \['127\.0\.0\.1:\d+'\]$", spec, re.M), spec
        assert re.search(r"^worker \['127\.0\.0\.1:\d+', '127\.0\.0\.1:\d+'\]$", spec, re.M), spec
        first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+)", training).groups())
        assert last < first / 4, training
        assert "variables on: ['/job:ps/replica:0/task:0/device:CPU:0']" in training
        learned = [float(v) for v in re.search(r"\[([^\]]+)\]", weights).group(1).split()]
        assert learned == pytest.approx([1.0, -2.0, 3.0, 0.5], abs=0.5)
        assert stopped.strip() == "['stopped', 'stopped', 'stopped']"
        paths = nb.page.evaluate(
            "() => Array.from(document.querySelectorAll('.cmlcluster-loss path')).map(p => p.getAttribute('d') || '')"
        )
        assert max((d.count("L") for d in paths), default=0) >= 5, paths  # a line through 10 epochs' losses
        assert nb.page.locator(".cmlcluster-loss").first.is_visible()
        nb.page.locator(".cmlcluster-loss").first.scroll_into_view_if_needed()
        nb.screenshot("loss-curve")
        assert nb.errors() == []


IDLE_CLUSTER = """\
import cmlcluster as cdsw
workers = cdsw.launch_workers(2, cpu=0.5, memory=0.5)
ready = cdsw.await_workers(workers, wait_for_completion=False, timeout_seconds=120)
print(*[cdsw.get_session().worker_pid(w) for w in ready["workers"]])
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_button_stops_an_idle_cluster(tmp_path):
    write_notebook(tmp_path, "idle.ipynb", [IDLE_CLUSTER])
    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "idle.ipynb", artifact_name="stop_button") as nb:
        nb.run_all(timeout=180)
        pids = [int(p) for p in nb.stdout(0).split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        rows = nb.page.locator("table.cmlcluster-workers tr[data-worker]")
        assert rows.count() == 2
        nb.page.locator(".cmlcluster-session button", has_text="Stop").click()
        nb.page.wait_for_function(
            "() => [...document.querySelectorAll('table.cmlcluster-workers tr[data-worker]')]"
            ".every(row => row.dataset.status === 'stopped')",
            timeout=30_000,
        )
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
        nb.screenshot("stopped")
        assert nb.errors() == []


SLEEPING_CLUSTER = """\
import cmlcluster as cdsw
workers = cdsw.launch_workers(2, cpu=0.5, memory=0.5, code="import time; time.sleep(600)")
ready = cdsw.await_workers(workers, wait_for_completion=False, timeout_seconds=120)
print(*[cdsw.get_session().worker_pid(w) for w in ready["workers"]])
"""

STOP_BUTTON = ".cmlcluster-session button.jupyter-button"


def test_stop_button_ends_a_cell_waiting_in_await_workers(tmp_path):
    cells = [SLEEPING_CLUSTER, "cdsw.await_workers(workers, wait_for_completion=True)"]
    write_notebook(tmp_path, "waiting.ipynb", cells)
    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "waiting.ipynb", artifact_name="stop_running_cell") as nb:
        nb.start_all()
        state = nb.wait_for(
            lambda s: s["cells"][0]["stdout"] and s["cells"][0]["count"] and s["kernel"] == "busy",
            "the second cell waiting",
            timeout=180,
        )
        pids = [int(p) for p in "".join(state["cells"][0]["stdout"]).split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        time.sleep(1)  # well inside await_workers
        # The waiting cell's own view (a view per call): its Stop ends the call and the workers it waits for.
        button = nb.page.locator(STOP_BUTTON, has_text="Stop").last
        assert button.is_enabled() and "mod-danger" in button.get_attribute("class")
        button.click()
        clicked = time.monotonic()
        while any(alive(p) for p in pids) and time.monotonic() < clicked + 15:
            time.sleep(0.05)
        stopped_after = time.monotonic() - clicked
        state = nb.wait_for(lambda s: s["kernel"] == "idle" and not s["running"], "the cell ending", timeout=15)
        ended_after = time.monotonic() - clicked
        print(f"click -> workers gone {stopped_after:.2f} s, cell ended and kernel idle {ended_after:.2f} s")
        assert not any(alive(p) for p in pids)
        assert stopped_after < 5
        [error] = state["cells"][1]["errors"]
        assert error == "StoppedFromWidget: stopped from the widget: workers w0, w1 stopped", error
        nb.page.wait_for_function(  # nothing behind either view runs: disabled, and no longer red
            f"() => [...document.querySelectorAll({STOP_BUTTON!r})].filter(b => b.textContent.includes('Stop'))"
            ".every(b => b.disabled && !b.classList.contains('mod-danger'))",
            timeout=10_000,
        )
        statuses = nb.page.locator("table.cmlcluster-workers tr[data-worker]").evaluate_all(
            "rows => rows.map(r => r.dataset.status)"
        )
        assert statuses == ["stopped"] * 4  # both views: the launching cell's and the waiting cell's
        nb.screenshot("stopped")
        assert [e for e in nb.errors() if "StoppedFromWidget" not in e] == []
