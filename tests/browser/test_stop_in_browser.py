"""The widget's Stop while a cell runs a job, clicked in JupyterLab in headless Chromium: %%horovod,
%%torchrun and a coordinator's model.fit (await_workers: test_widgets_in_browser.py). Each job runs
until stopped; the click must end every process of it within 5 s, end the cell with StoppedFromWidget,
and leave the button grey and disabled. Before %%torchrun's Stop, its X-ray button shows both ranks."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest
from harness.processes import command_line, is_worker_agent, own_tree

from browser.jupyterlab import NotebookPage, jupyter_lab, open_notebook, write_notebook

pytestmark = pytest.mark.browser

STOP_BUTTON = ".cmlcluster-session button.jupyter-button"
# What a job is on this machine: workers' agents, and what they or the kernel ran (horovodrun, torchrun, ranks).
JOB_COMMANDS = ("horovod", "torch")

# A rank that says it started (a file named by its pid in the notebook's folder), then waits to be stopped.
RANK = """\
import os, time
open(os.path.join({folder!r}, f"started-{{os.getpid()}}"), "w").close()
time.sleep(600)
"""

BUTTON_IDLE = (  # nothing behind it runs: disabled, and no longer red
    f"() => {{ const b = document.querySelector({STOP_BUTTON!r});"
    " return b.disabled && !b.classList.contains('mod-danger'); }"
)


def job_processes() -> list[psutil.Process]:
    """The job's processes in this test's tree: workers' agents, horovodrun, torchrun, ranks and their children."""
    job = [p for p in own_tree() if is_worker_agent(p) or any(c in command_line(p) for c in JOB_COMMANDS)]
    for p in list(job):
        try:
            job += [c for c in p.children(recursive=True) if c not in job]
        except psutil.Error:
            pass
    return job


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_files(folder: Path, pattern: str, count: int, nb: NotebookPage, timeout: float) -> None:
    """Wait until `count` files match `pattern` in `folder`; fail naming the cells' errors if the run ended first."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"no {count} {pattern} within {timeout} s: {nb.cell_errors()}"
        assert not nb.cell_errors(), nb.cell_errors()
        nb.page.wait_for_timeout(250)


def stop_and_check(nb: NotebookPage, cell: int, message: str) -> None:
    """Click Stop while cell `cell` runs the job; check that the job ends within 5 s, and how the cell and
    the button end."""
    time.sleep(1)  # well inside the job
    job = job_processes()
    assert job and all(alive(p) for p in job)
    button = nb.page.locator(STOP_BUTTON, has_text="Stop").last
    assert button.is_enabled() and "mod-danger" in (button.get_attribute("class") or "")
    button.click()
    clicked = time.monotonic()
    while any(alive(p) for p in job) and time.monotonic() < clicked + 15:
        time.sleep(0.05)
    gone_after = time.monotonic() - clicked
    state = nb.wait_for(lambda s: s["kernel"] == "idle" and not s["running"], "the cell ending", timeout=15)
    ended_after = time.monotonic() - clicked
    print(f"click -> {len(job)} processes gone {gone_after:.2f} s, cell ended and kernel idle {ended_after:.2f} s")
    assert [command_line(p) for p in job if alive(p)] == []
    assert gone_after < 5
    [error] = state["cells"][cell]["errors"]
    assert re.fullmatch(f"StoppedFromWidget: {message}", error), error
    nb.page.wait_for_function(BUTTON_IDLE, timeout=10_000)
    nb.page.locator(".jp-Notebook .jp-Cell").nth(cell).scroll_into_view_if_needed()
    nb.screenshot("stopped")
    assert [e for e in nb.errors() if "StoppedFromWidget" not in e] == []


@pytest.mark.matrix  # the widget's path is await_workers' and torchrun's; horovodrun's stop: test_kernel.py
def test_stop_ends_a_cell_running_horovod(tmp_path):
    cells = ["%load_ext cmlcluster", f"%%horovod -np 2\n{RANK.format(folder=str(tmp_path))}"]
    write_notebook(tmp_path, "horovod.ipynb", cells)
    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "horovod.ipynb", artifact_name="stop_horovod") as nb:
        nb.start_all()
        wait_for_files(tmp_path, "started-*", 2, nb, timeout=120)
        # On this machine horovodrun starts the ranks itself: no worker was running.
        stop_and_check(nb, 1, r"stopped from the widget: the call was interrupted \(no workers were running\)")


def test_xray_then_stop_in_a_cell_running_torchrun(tmp_path):
    cells = ["%load_ext cmlcluster", f"%%torchrun --nnodes 2\n{RANK.format(folder=str(tmp_path))}"]
    write_notebook(tmp_path, "torch.ipynb", cells)
    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "torch.ipynb", artifact_name="stop_torchrun") as nb:
        nb.start_all()
        wait_for_files(tmp_path, "started-*", 2, nb, timeout=120)
        # The X-ray button acts while the cell runs: both ranks' stacks come into the view.
        nb.page.locator(STOP_BUTTON, has_text="X-ray").last.click()
        nb.page.wait_for_function(XRAY_SHOWN, timeout=30_000)
        report = nb.page.locator(".cmlcluster-session .cmlcluster-xray").last.inner_text()
        assert "ranks 0-1: at torchrun_cell.py:3 in <module>: time.sleep(600)" in report, report
        nb.screenshot("xray")
        stop_and_check(nb, 1, r"stopped from the widget: workers node 0, node 1 stopped")


XRAY_SHOWN = (
    "() => [...document.querySelectorAll('.cmlcluster-session .cmlcluster-xray')]"
    ".some(e => e.textContent.includes('X-ray of 2 ranks on 2 workers'))"
)


COORDINATOR = """\
import numpy as np, tensorflow as tf
import cmlcluster as cdsw

cluster = cdsw.start_cluster(n_workers=1, n_ps=1, cpu=1, memory=2)
strategy = tf.distribute.ParameterServerStrategy(cluster.resolver)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")


def dataset(_context):
    x = np.random.default_rng(0).random((256, 4), dtype=np.float32)
    return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1))).repeat().batch(32)
"""

FIT = """\
trained = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: open({marker!r}, "w").close())
model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=100_000, steps_per_epoch=10, verbose=0,
          callbacks=[trained])
"""


def test_stop_ends_a_coordinators_model_fit(tmp_path):
    cells = [COORDINATOR, FIT.format(marker=str(tmp_path / "trained"))]
    write_notebook(tmp_path, "fit.ipynb", cells)
    with jupyter_lab(tmp_path) as lab, open_notebook(lab, "fit.ipynb", artifact_name="stop_fit") as nb:
        nb.start_all()
        wait_for_files(tmp_path, "trained", 1, nb, timeout=180)  # an epoch is done: fit is training
        stop_and_check(nb, 1, r"stopped from the widget: workers ps 0, worker 0 stopped")
        # TensorFlow's threads said nothing under the cell about the workers' end; the next cluster in
        # the same kernel trains: tests/integration/test_tf_stop.py.
        assert not [s for s in nb.stderr() if "UnavailableError" in s], nb.stderr()
