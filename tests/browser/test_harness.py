"""The browser harness itself: a notebook with ipywidgets, run in JupyterLab in headless Chromium."""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import time

import psutil
import pytest
from harness.processes import command_line, own_tree

from browser.jupyterlab import CHROMIUM, TEMP_PREFIX, jupyter_lab, open_notebook, write_notebook

pytestmark = pytest.mark.browser

PROBE = """\
import sys
import ipywidgets as widgets
from IPython.display import display

print(sys.executable)
print(sys.prefix)
display(widgets.IntProgress(value=3, max=10, description="probe"))
display(widgets.HTML(
    "<table class='probe-table'><tr><th>worker</th><th>state</th></tr>"
    "<tr><td>w0</td><td>running</td></tr><tr><td>w1</td><td>stopped</td></tr></table>"
))
"""

# What the harness starts: the server, its kernels, Playwright's driver, Chromium and its helpers.
HARNESS_PROCESS_MARKS = ("jupyter-lab", f"{TEMP_PREFIX}jupyterlab-", "/usr/lib/chromium/", "playwright/driver")


def harness_processes() -> dict[int, str]:
    found = {}
    for proc in own_tree():
        cmdline = command_line(proc)
        if any(m in cmdline for m in HARNESS_PROCESS_MARKS):
            found[proc.pid] = cmdline[:200]
    return found


def harness_temp_folders() -> set[str]:
    temp = tempfile.gettempdir()
    patterns = (f"{TEMP_PREFIX}jupyterlab-*", f"{TEMP_PREFIX}chromium-*", "playwright*")
    return {path for pattern in patterns for path in glob.glob(os.path.join(temp, pattern))}


def alive(pids, within: float) -> list[int]:
    """The pids among `pids` still running (zombies count as gone) after at most `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_widgets_render_in_jupyterlab_in_chromium(tmp_path):
    processes_before = harness_processes()
    temp_before = harness_temp_folders()
    write_notebook(tmp_path, "probe.ipynb", [PROBE])

    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "probe.ipynb", artifact_name="test_harness-probe") as nb:
        nb.run_all(timeout=120)
        # command_line(): a child may be a zombie meanwhile (this process reaps the run's orphans), whose
        # cmdline() raises.
        started = {p.pid: command_line(p)[:200] for p in psutil.Process().children(recursive=True)}
        page = nb.page

        bar = page.locator(".widget-hprogress")
        assert bar.count() == 1, page.locator(".jp-OutputArea").inner_text()
        assert bar.locator(".widget-label").inner_text() == "probe"
        assert bar.locator(".progress-bar").evaluate("el => el.style.width") == "30%"
        table = page.locator(".widget-html-content table.probe-table")
        assert table.count() == 1
        assert table.locator("th").all_inner_texts() == ["worker", "state"]
        assert table.locator("td").all_inner_texts() == ["w0", "running", "w1", "stopped"]

        executable, prefix = nb.stdout(0).split()
        assert prefix == sys.prefix, f"the kernel runs {executable}, not this venv's Python"
        assert os.path.samefile(executable, sys.executable)
        assert nb.errors() == []
        assert nb.screenshots and nb.screenshots[-1].stat().st_size > 0

    assert any("jupyter-lab" in c for c in started.values()), started
    assert any("ipykernel_launcher" in c for c in started.values()), started
    assert any(c.startswith(CHROMIUM.replace("/usr/bin/", "/usr/lib/chromium/")) for c in started.values()), started
    left = alive(started, within=10)
    assert not left, f"still running after the harness: {[started[p] for p in left]}"
    new = {pid: c for pid, c in harness_processes().items() if pid not in processes_before}
    assert not new, f"harness processes left: {new}"
    assert harness_temp_folders() == temp_before


def test_missing_chromium_fails_with_the_install_command(monkeypatch, tmp_path):
    """Without Debian's chromium the harness fails (never skips), naming the install command."""
    from browser import jupyterlab as harness

    monkeypatch.setattr(harness, "CHROMIUM", str(tmp_path / "no-chromium"))
    with pytest.raises(harness.HarnessError, match=r"bash scripts/install\.sh dev"):
        harness.require_chromium()
