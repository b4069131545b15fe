"""A real JupyterLab in a real browser, for tests of what a notebook user sees (ipywidgets above all).

Two context managers, used together:

    with jupyter_lab(folder) as lab, open_notebook(lab, "probe.ipynb", artifact_name="probe") as nb:
        nb.run_all(timeout=120)
        assert nb.errors() == []
        assert nb.page.locator(".widget-hprogress .progress-bar").count() == 1

`jupyter_lab` starts `jupyter lab` from this venv on 127.0.0.1 (a port the OS picks, read back from the
server's own runtime file, so no other process can take it in between), with a random token and its own
HOME, config, data and runtime folders: the user's settings, workspaces and kernelspecs stay out. It always
stops the server, its kernels and anything they started, and removes its folders.

`open_notebook` drives Debian's chromium (/usr/bin/chromium) through Playwright: it opens the notebook,
waits for its kernel to be idle, and collects console errors, page errors, JupyterLab dialogs, cell
errors and ipywidgets' own error renderings (see `WIDGET_ERRORS_JS`). Screenshots go to test-artifacts/.

How the notebook is run: JupyterLab is started with `LabApp.expose_app_in_browser` (what JupyterLab's own
Galata test framework does), and the harness executes the command `notebook:run-all-cells` on the app's
command registry. That is the very command the menu item "Run > Run All Cells" dispatches, without what
makes a menu click or a key press flaky: menu layout and labels, a toast or dialog covering the menu bar,
keyboard focus sitting in a cell editor or the file browser.

The module is `browser.jupyterlab` (tests/browser is a package) so that it does not shadow the real
`jupyterlab` package on sys.path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
VENV_BIN = Path(sys.executable).parent
JUPYTER_LAB = VENV_BIN / "jupyter-lab"
CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright's own browser builds are never downloaded
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
INSTALL_HINT = "run `bash scripts/install.sh dev` (as root: it installs Debian's chromium, playwright and jupyterlab)"
TEMP_PREFIX = "cmlcluster-"  # the suite's leak check (tests/conftest.py) watches temp folders named so

# User settings for the private JupyterLab: no "news" question toast, no update check; a notebook without a
# kernelspec starts the default kernel instead of asking in a dialog; every cell fully rendered in the DOM
# (no windowing), so that queries and screenshots see all outputs.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
}

# Environment variables that would point the server or its kernels at the user's Jupyter files.
PRIVATE_ENV_DROP = (
    "JUPYTER_PATH",
    "JUPYTER_CONFIG_PATH",
    "JUPYTER_PLATFORM_DIRS",
    "JUPYTER_TOKEN_FILE",
    "PYTHONSTARTUP",
)


class HarnessError(RuntimeError):
    """The browser harness cannot run, or JupyterLab did not get where it should within its deadline."""


# --------------------------------------------------------------------------------------------------
# The server


@dataclass(frozen=True)
class LabServer:
    """A running `jupyter lab`: where it answers, its token, and what it serves."""

    url: str  # http://127.0.0.1:PORT
    token: str
    root_dir: Path
    pid: int
    log_path: Path

    def lab_url(self, notebook: str) -> str:
        """The URL that opens `notebook` (a path relative to root_dir) in JupyterLab, token included."""
        path = urllib.parse.quote(Path(notebook).as_posix())
        return f"{self.url}/lab/tree/{path}?token={self.token}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no server log: {e})"

    def processes(self) -> list[psutil.Process]:
        """The server and every process under it (kernels and what they started)."""
        with contextlib.suppress(psutil.Error):
            server = psutil.Process(self.pid)
            return [server, *server.children(recursive=True)]
        return []


def _private_env(home: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV_DROP}
    env.update(
        HOME=str(home),
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "config" / "lab" / "user-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "config" / "lab" / "workspaces"),
        IPYTHONDIR=str(home / "ipython"),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        PYTHONNOUSERSITE="1",
    )
    env.update(extra or {})
    return env


def _write_lab_settings(settings_dir: Path) -> None:
    for plugin, values in LAB_SETTINGS.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values, indent=2))


def _read_port(runtime_dir: Path, pid: int) -> int | None:
    """The port the server listens on, from the jpserver-<pid>.json it writes once it is bound."""
    try:
        return int(json.loads((runtime_dir / f"jpserver-{pid}.json").read_text())["port"])
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or half written


def _answers(url: str, token: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop_tree(proc: subprocess.Popen, grace: float) -> list[str]:
    """TERM the server's process group (it shuts its kernels down), then KILL whatever of its tree is left.

    Kernels run in sessions of their own (jupyter_client starts them so), so the tree is read before the
    signal; anything still alive after `grace` seconds is killed with its process group. Returns what had
    to be killed.
    """
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    killed = []
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        killed.append(f"jupyter-lab (pid {proc.pid})")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{' '.join(p.cmdline())[:200]} (pid {p.pid})")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # a kernel leads its own group: take its children too
            p.kill()
    psutil.wait_procs(alive, timeout=grace)
    return killed


@contextlib.contextmanager
def jupyter_lab(
    root_dir: str | os.PathLike,
    *,
    env: dict[str, str] | None = None,
    startup_timeout: float = 90.0,
    stop_timeout: float = 15.0,
) -> Iterator[LabServer]:
    """Run `jupyter lab` serving `root_dir` for the duration of the block; stop it and clean up after.

    The server listens on 127.0.0.1 only, on a port the OS picks, with a random token, no browser, and
    HOME, Jupyter config/data/runtime, IPython and JupyterLab settings/workspace folders of its own in one
    temp folder (removed afterwards). Kernels are this venv's Python: the venv's `python3` kernelspec
    says `python`, which jupyter_client runs as the server's own interpreter. `env` adds variables for the
    server and its kernels. Raises HarnessError, with the server's exit code and last log lines, when it
    does not answer /api/status within `startup_timeout` seconds.
    """
    if not JUPYTER_LAB.exists():
        raise HarnessError(f"{JUPYTER_LAB} not found: {INSTALL_HINT}")
    root = Path(root_dir).resolve()
    if not root.is_dir():
        raise HarnessError(f"root_dir {root} is not a folder")
    home = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}jupyterlab-"))
    proc = None
    try:
        _write_lab_settings(home / "config" / "lab" / "user-settings")
        (home / "runtime").mkdir()
        token = secrets.token_hex(24)
        argv = [
            str(JUPYTER_LAB),
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port=0",  # the OS picks a free port; the server writes it to its runtime file
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: see the module docstring
            "--LabApp.news_url=None",  # no news feed fetched from the internet
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",  # lists what is installed; never asks PyPI
            # Kernels on unix sockets in this server's folder, which no other test's stray client reaches
            # (tests/harness/kernels.py says why); named k-<n> there, short enough for a socket's path.
            "--KernelManager.transport=ipc",
            f"--KernelManager.ip={home / 'k'}",
        ]
        if os.geteuid() == 0:  # CI and the dev machines run as root; the server refuses that by default
            argv.append("--ServerApp.allow_root=True")
        log_path = home / "jupyter-lab.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=root,
                env={**_private_env(home, env), "JUPYTER_TOKEN": token},  # in env, not argv: ps shows argv
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so that one signal reaches all of it
            )
        deadline = time.monotonic() + startup_timeout
        url = None
        while True:
            if proc.poll() is not None:
                raise HarnessError(
                    f"jupyter lab exited with code {proc.returncode} before answering\n"
                    f"argv: {argv}\n{LabServer('', '', root, proc.pid, log_path).log_tail()}"
                )
            port = _read_port(home / "runtime", proc.pid)
            url = f"http://127.0.0.1:{port}" if port else None
            if url and _answers(url, token):
                break
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"jupyter lab did not answer /api/status within {startup_timeout}s (port: {port})\n"
                    f"argv: {argv}\n{LabServer('', '', root, proc.pid, log_path).log_tail()}"
                )
            time.sleep(0.2)
        yield LabServer(url=url, token=token, root_dir=root, pid=proc.pid, log_path=log_path)
    finally:
        try:
            if proc is not None:
                _stop_tree(proc, stop_timeout)
        finally:
            shutil.rmtree(home, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The browser

# Everything the harness needs to know about the notebook panel, read from JupyterLab's own models.
STATE_JS = """
(path) => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return {stage: 'loading JupyterLab'};
  let panel = null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.content.model && w.content.model.cells) {
      panel = w;
      break;
    }
  }
  if (!panel) return {stage: 'opening the notebook'};
  if (!panel.context.isReady) return {stage: 'loading the notebook'};
  const session = panel.sessionContext.session;
  const kernel = session ? session.kernel : null;
  const model = panel.content.model;
  const cells = [];
  for (let i = 0; i < model.cells.length; i++) {
    const c = model.cells.get(i);
    const cell = {index: i, type: c.type};
    if (c.type === 'code') {
      const outputs = [];
      for (let j = 0; j < c.outputs.length; j++) outputs.push(c.outputs.get(j).toJSON());
      const text = (t) => (Array.isArray(t) ? t.join('') : String(t));
      cell.count = c.executionCount;
      cell.empty = c.sharedModel.getSource().trim() === '';
      cell.errors = outputs.filter((o) => o.output_type === 'error').map((o) => `${o.ename}: ${o.evalue}`);
      cell.stderr = outputs.filter((o) => o.output_type === 'stream' && o.name === 'stderr').map((o) => text(o.text));
      cell.stdout = outputs.filter((o) => o.output_type === 'stream' && o.name === 'stdout').map((o) => text(o.text));
    }
    cells.push(cell);
  }
  const prompts = Array.from(panel.content.node.querySelectorAll('.jp-InputPrompt'));
  const indicator = panel.node.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    stage: 'ready',
    sessionReady: panel.sessionContext.isReady,
    kernelName: kernel ? kernel.name : null,
    kernel: kernel ? kernel.status : 'no kernel',
    connection: kernel ? kernel.connectionStatus : null,
    indicator: indicator ? indicator.dataset.status : null,
    running: prompts.filter((p) => p.textContent.includes('*')).length,
    cells: cells,
  };
}
"""

RUN_ALL_JS = """
async (path) => {
  const app = window.jupyterapp;
  const panel = Array.from(app.shell.widgets('main')).find((w) => w.context && w.context.path === path);
  app.shell.activateById(panel.id);
  // Outputs and execution counts of an earlier run must not count as this run's.
  await app.commands.execute('notebook:clear-all-cell-outputs');
  window.__harnessRunError = null;
  app.commands.execute('notebook:run-all-cells').catch((e) => { window.__harnessRunError = String(e); });
}
"""

# What ipywidgets 8 (@jupyter-widgets/jupyterlab-manager) shows when a widget fails, from its source:
# - the output's renderer writes "Error displaying widget: model not found" (the kernel-side model is
#   unknown to the page) or "Error displaying widget" (the view could not be created), class jupyter-widgets;
# - a widget class that fails to load is replaced by an ErrorWidgetView: `.jupyter-widgets-error-widget`
#   ("Click to show javascript error.");
# - "Loading widget..." left in place: the model never arrived (no comm to the kernel, no labextension);
# - an Output widget (where widget callbacks should send their exceptions) showing stderr.
# Each of these also logs to the console, which the harness collects separately.
WIDGET_ERRORS_JS = """
(path) => {
  const app = window.jupyterapp;
  const panel = Array.from(app.shell.widgets('main')).find((w) => w.context && w.context.path === path);
  if (!panel) return [];
  const found = [];
  const cellOf = (el) => {
    const cell = el.closest('.jp-Cell');
    const index = cell ? Array.from(panel.content.node.querySelectorAll('.jp-Cell')).indexOf(cell) : -1;
    return `cell ${index}`;
  };
  for (const out of panel.node.querySelectorAll('.jp-OutputArea-output')) {
    const text = out.innerText.trim();
    if (text.startsWith('Error displaying widget')) found.push(`${cellOf(out)}: ${text}`);
    else if (text === 'Loading widget...') found.push(`${cellOf(out)}: widget never rendered (Loading widget...)`);
  }
  for (const el of panel.node.querySelectorAll('.jupyter-widgets-error-widget')) {
    found.push(`${cellOf(el)}: ipywidgets error view: ${el.innerText.trim()}`);
  }
  const stderr = '.jupyter-widgets .jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]';
  for (const el of panel.node.querySelectorAll(stderr)) {
    found.push(`${cellOf(el)}: stderr in an Output widget: ${el.innerText.trim()}`);
  }
  return found;
}
"""

LOADING_WIDGETS_JS = """
(path) => {
  const app = window.jupyterapp;
  const panel = Array.from(app.shell.widgets('main')).find((w) => w.context && w.context.path === path);
  return panel ? Array.from(panel.node.querySelectorAll('.jp-OutputArea-output'))
    .filter((o) => o.innerText.trim() === 'Loading widget...').length : 0;
}
"""


def _import_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise HarnessError(f"Playwright is not installed in {sys.prefix} ({e}): {INSTALL_HINT}") from e
    return sync_playwright


def require_chromium() -> str:
    """The path of Debian's chromium; HarnessError with the install command when it is missing."""
    if not os.access(CHROMIUM, os.X_OK):
        raise HarnessError(f"{CHROMIUM} not found: the browser tests need Debian's chromium package: {INSTALL_HINT}")
    return CHROMIUM


def _artifact_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "notebook"


@dataclass
class NotebookPage:
    """A notebook open in JupyterLab in headless Chromium, and everything that went wrong on the page.

    `page` is Playwright's Page: query the DOM with it. Collected as they happen: `console_errors`
    (console messages of type error, minus `ignore_console` patterns), `console_warnings`, `page_errors`
    (uncaught exceptions), `dialogs` (JupyterLab dialogs other than kernel selection, each dismissed),
    `notifications` (JupyterLab's error toasts seen while the harness polls: a kernel that failed to start).
    Read on demand from the page: `cell_errors()`, `widget_errors()`, `stderr()`. `errors()` is all that
    counts as a failure.
    """

    page: Any
    server: LabServer
    notebook: str
    artifact_name: str
    ignore_console: tuple[re.Pattern, ...] = ()
    console_errors: list[str] = field(default_factory=list)
    console_warnings: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    notifications: list[str] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)
    network_changed: int = 0  # requests Chromium dropped as this host's interfaces changed (see open_notebook)

    # -- events

    def _on_console(self, message) -> None:
        location = message.location or {}
        where = f" ({location.get('url', '')}:{location.get('lineNumber', '')})" if location.get("url") else ""
        text = f"{message.text}{where}"
        if message.type == "error" and NETWORK_CHANGED in text:
            self.network_changed += 1
        elif message.type == "error" and not any(p.search(text) for p in self.ignore_console):
            self.console_errors.append(text)
        elif message.type == "warning":
            self.console_warnings.append(text)

    def forget_errors(self) -> None:
        """Drop everything collected so far (before loading the page again)."""
        for collected in (
            self.console_errors,
            self.console_warnings,
            self.page_errors,
            self.dialogs,
            self.notifications,
        ):
            collected.clear()
        self.network_changed = 0

    def _on_page_error(self, error) -> None:
        self.page_errors.append(f"{getattr(error, 'name', 'Error')}: {getattr(error, 'message', error)}")

    # -- reading the page

    def state(self) -> dict:
        """JupyterLab's view of the notebook: loading stage, kernel status, and per cell its count and outputs."""
        return self.page.evaluate(STATE_JS, self.notebook)

    def cell_errors(self) -> list[str]:
        """'cell N: Ename: evalue' for each error output (a raised exception) in the notebook."""
        state = self.state()
        return [f"cell {c['index']}: {e}" for c in state.get("cells", []) for e in c.get("errors", [])]

    def stderr(self) -> list[str]:
        """What cells wrote to stderr (warnings land here too, so it is not counted as an error)."""
        state = self.state()
        return [f"cell {c['index']}: {s}" for c in state.get("cells", []) for s in c.get("stderr", [])]

    def stdout(self, cell: int) -> str:
        """What cell number `cell` printed (0-based, counting every cell, markdown too)."""
        return "".join(self.state()["cells"][cell].get("stdout", []))

    def widget_errors(self) -> list[str]:
        """ipywidgets' error renderings on the page (see WIDGET_ERRORS_JS)."""
        return self.page.evaluate(WIDGET_ERRORS_JS, self.notebook)

    def errors(self) -> list[str]:
        """Everything that went wrong: page and console errors, dialogs, error toasts, cell and widget errors.

        Not a fetch that Chromium dropped as this host's interfaces changed (Docker adding or removing a
        container's, for the other test process): where it did (net::ERR_NETWORK_CHANGED on the console), a
        page's uncaught "TypeError: Failed to fetch" is that request's, however the page handled it."""
        self._handle_dialogs()
        dropped = DROPPED_FETCH if self.network_changed else None
        return [
            *(f"page error: {e}" for e in self.page_errors if e != dropped),
            *(f"console error: {e}" for e in self.console_errors),
            *(f"dialog: {d}" for d in self.dialogs),
            *(f"notification: {n}" for n in self.notifications),
            *(f"cell error: {e}" for e in self.cell_errors()),
            *(f"widget error: {e}" for e in self.widget_errors()),
        ]

    def screenshot(self, label: str = "") -> Path:
        """Write test-artifacts/<artifact_name>[-label].png and return its path."""
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{self.artifact_name}{'-' + _artifact_stem(label) if label else ''}.png"
        self.page.screenshot(path=str(path))
        self.screenshots.append(path)
        return path

    # -- dialogs and waiting

    def _handle_dialogs(self) -> None:
        """Accept JupyterLab's kernel selection dialog; record and dismiss (Escape) any other dialog; record
        error toasts (others, like the news question, which the settings turn off, block nothing: they stay).

        Escape is Cancel in a JupyterLab dialog: an unknown dialog never gets its accept button pressed, which
        could mean "restart" or "overwrite".
        """
        from playwright.sync_api import Error as PlaywrightError

        dialogs = self.page.locator(".jp-Dialog")
        with contextlib.suppress(PlaywrightError):  # a dialog can close between count() and the reads
            for i in range(dialogs.count()):
                dialog = dialogs.nth(i)
                header = dialog.locator(".jp-Dialog-header").inner_text(timeout=2000).strip()
                if header.startswith("Select Kernel"):
                    dialog.locator("button.jp-mod-accept").click(timeout=2000)
                    continue
                text = " ".join(dialog.inner_text(timeout=2000).split())
                if text not in self.dialogs:
                    self.dialogs.append(text)
                self.page.keyboard.press("Escape")
            toasts = self.page.locator(".jp-toastContainer .Toastify__toast--error .jp-toast-message")
            for text in toasts.all_inner_texts():
                text = " ".join(text.split())
                if text not in self.notifications:
                    self.notifications.append(text)

    def wait_for(self, done, what: str, timeout: float) -> dict:
        """Poll `state()` until `done(state)`; dismiss dialogs meanwhile. HarnessError with evidence on timeout.

        An unexpected dialog (a dead kernel, a load error) ends the wait at once: it is a failure whatever
        happens next.
        """
        deadline = time.monotonic() + timeout
        state: dict = {}
        while True:
            self._handle_dialogs()
            state = self.state()
            if done(state):
                return state
            if self.dialogs or time.monotonic() > deadline:
                reason = f"a dialog appeared: {self.dialogs}" if self.dialogs else f"not within {timeout}s"
                shot = self._failure_screenshot(what)
                raise HarnessError(
                    f"{self.notebook}: {what}: {reason}\nlast state: {json.dumps(state)[:3000]}\n"
                    f"page errors: {self.page_errors}\nconsole errors: {self.console_errors}\n"
                    f"screenshot: {shot}\nserver log:\n{self.server.log_tail()}"
                )
            self.page.wait_for_timeout(250)  # keeps Playwright's event dispatch (console, page errors) going

    def _failure_screenshot(self, label: str) -> Path | str:
        try:
            return self.screenshot(f"failed-{label}")
        except Exception as e:  # the page may be gone; the error being raised matters more
            return f"(none: {e})"

    def wait_until_idle(self, timeout: float = 90.0) -> dict:
        """Wait until the notebook is loaded and its kernel is connected and idle."""

        def idle(s: dict) -> bool:
            return (
                s.get("stage") == "ready"
                and s["sessionReady"]
                and s["kernel"] == "idle"
                and s["connection"] == "connected"
                and s["running"] == 0
            )

        return self.wait_for(idle, "notebook loaded, kernel idle", timeout)

    def start_all(self, timeout: float = 90.0) -> None:
        """Clear outputs and start running all cells (Run All Cells) once the kernel is idle; return at once."""
        self.wait_until_idle(timeout)
        self.page.evaluate(RUN_ALL_JS, self.notebook)

    def run_all(self, timeout: float = 120.0, widget_timeout: float = 15.0) -> dict:
        """Clear outputs, run all cells, and wait until the run is over; then let widgets finish rendering.

        The run is over when the kernel is idle, no prompt shows [*], and either every non-empty code cell
        has an execution count or a cell raised (Run All stops there). Widgets still "Loading widget..."
        after `widget_timeout` seconds are left for widget_errors() to report. Writes
        test-artifacts/<artifact_name>.png. Returns the final state().
        """
        self.start_all(timeout)

        def finished(s: dict) -> bool:
            if s.get("stage") != "ready" or s["kernel"] != "idle" or s["running"]:
                return False
            code = [c for c in s["cells"] if c["type"] == "code" and not c["empty"]]
            return all(c["count"] is not None for c in code) or any(c["errors"] for c in code)

        state = self.wait_for(finished, "running all cells", timeout)
        deadline = time.monotonic() + widget_timeout
        while self.page.evaluate(LOADING_WIDGETS_JS, self.notebook) and time.monotonic() < deadline:
            self.page.wait_for_timeout(250)
        run_error = self.page.evaluate("() => window.__harnessRunError")
        if run_error:
            self.page_errors.append(f"notebook:run-all-cells failed: {run_error}")
        self.screenshot()
        return state


# Chromium's error for a request dropped because the host's network interfaces changed.
NETWORK_CHANGED = "net::ERR_NETWORK_CHANGED"
DROPPED_FETCH = "TypeError: Failed to fetch"  # what a page's fetch() rejects with when Chromium drops it


@contextlib.contextmanager
def open_notebook(
    server: LabServer,
    notebook: str,
    *,
    artifact_name: str | None = None,
    ignore_console: Iterable[str] = (),
    viewport: tuple[int, int] = (1280, 900),
    load_timeout: float = 90.0,
) -> Iterator[NotebookPage]:
    """Open `notebook` (relative to the server's root_dir) in headless Chromium and wait for an idle kernel.

    Chromium is Debian's, launched by Playwright with exactly CHROMIUM_ARGS and a HOME of its own (removed
    afterwards). `ignore_console` are regular expressions for console errors a test expects. On an
    exception in the block, test-artifacts/<artifact_name>-failed.png is written. The browser and
    Playwright's driver are always closed.
    """
    sync_playwright = _import_playwright()
    chromium = require_chromium()
    name = _artifact_stem(artifact_name or Path(notebook).stem)
    home = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}chromium-"))
    try:
        browser_env = {
            **os.environ,
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_CACHE_HOME": str(home / ".cache"),
        }
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=chromium, args=list(CHROMIUM_ARGS), env=browser_env, timeout=60_000
            )
            try:
                context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
                page = context.new_page()
                page.set_default_timeout(30_000)
                nb = NotebookPage(
                    page=page,
                    server=server,
                    notebook=Path(notebook).as_posix(),
                    artifact_name=name,
                    ignore_console=tuple(re.compile(p) for p in ignore_console),
                )
                page.on("console", nb._on_console)
                page.on("pageerror", nb._on_page_error)
                page.on("crash", lambda _: nb.page_errors.append("the page crashed"))
                page.goto(server.lab_url(notebook), wait_until="domcontentloaded", timeout=load_timeout * 1000)
                try:
                    nb.wait_until_idle(load_timeout)
                except HarnessError:
                    if not nb.network_changed:
                        raise
                    # Docker adding or removing a container's interface on this host (the other test process's
                    # containers) makes Chromium drop its requests in flight: net::ERR_NETWORK_CHANGED, and
                    # JupyterLab's "Server Connection Error" before its kernel session exists. Nothing ran
                    # yet: load the notebook again, once, and forget what the dropped load reported (the
                    # chunks and styles it could not fetch), so that only the second load's errors count.
                    nb.forget_errors()
                    page.reload(wait_until="domcontentloaded", timeout=load_timeout * 1000)
                    nb.wait_until_idle(load_timeout)
                try:
                    yield nb
                except BaseException as e:  # pytest's failures are BaseExceptions
                    if not isinstance(e, (GeneratorExit, HarnessError)):  # a HarnessError took its own
                        nb._failure_screenshot("test")
                    raise
            finally:
                browser.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def write_notebook(folder: str | os.PathLike, name: str, cells: Iterable[str]) -> Path:
    """Write `cells` (code cell sources) as folder/name, a notebook with the venv's python3 kernelspec."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    path = Path(folder) / name
    nbformat.write(notebook, path)
    return path
