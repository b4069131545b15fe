"""The panel's server extension in a real Jupyter server (cmlcluster/lab/handlers.py): found and enabled in
this environment as pip installed it, behind the server's own authentication and XSRF check, stopping a
real worker through its session, and reading only worker logs."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from browser.jupyterlab import jupyter_lab

from cmlcluster.session import Session

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

JUPYTER = Path(sys.executable).parent / "jupyter"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_jupyter_finds_the_panel_and_its_server_extension_enabled(tmp_path):
    # Only what the environment holds (sys.prefix's share/ and etc/, as pip put them), not a user's folders.
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    env["PATH"] = f"{JUPYTER.parent}{os.pathsep}{env['PATH']}"

    def listed(*args: str) -> str:
        done = subprocess.run([str(JUPYTER), *args], capture_output=True, text=True, env=env, timeout=120)
        return ANSI.sub("", done.stdout + done.stderr)

    labextensions = listed("labextension", "list")
    assert re.search(r"cmlcluster-lab v\S+ enabled OK \(python, cmlcluster\)", labextensions), labextensions
    server = listed("server", "extension", "list")
    assert re.search(r"cmlcluster\.lab enabled", server) and re.search(r"cmlcluster\.lab +OK", server), server


def call(opener, url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None):
    """(status, JSON body) of a request."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"text": text.decode(errors="replace")}


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_rest_api_is_the_servers_to_guard_and_stops_a_real_worker(tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(state))
    with (
        Session("local", echo=False) as session,
        jupyter_lab(tmp_path, env={"CMLCLUSTER_STATE_DIR": str(state)}) as lab,
    ):
        code = "import time; print('worker up', flush=True); time.sleep(600)"
        [worker] = session.launch_workers(1, cpu=0.5, memory=0.5, code=code)
        session.await_workers([worker], wait_for_completion=False, timeout_seconds=60)
        session.drain(5)
        pid = session.worker_pid(worker)
        assert pid is not None
        api = f"{lab.url}/cmlcluster"
        stranger = urllib.request.build_opener()
        token = {"Authorization": f"token {lab.token}"}

        # No credentials: refused, by the server's authentication.
        assert call(stranger, f"{api}/sessions")[0] == 403
        assert call(stranger, f"{api}/sessions/{session.id}/stop", "POST", {"workers": "all"})[0] == 403
        assert call(stranger, f"{api}/cleanup", "POST")[0] == 403

        status, listed = call(stranger, f"{api}/sessions", headers=token)
        assert status == 200
        [live] = [s for s in listed["live"] if s["id"] == session.id]
        assert live["can_stop"] and live["state"] == "alive"
        assert [(w["id"], w["status"]) for w in live["workers"]] == [(worker["id"], "running")]

        # A browser's login: a cookie, and a POST without the XSRF token it was given is refused.
        jar = http.cookiejar.CookieJar()
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with browser.open(f"{lab.url}/lab?token={lab.token}", timeout=30):
            pass
        xsrf = next(c.value for c in jar if c.name == "_xsrf")
        assert call(browser, f"{api}/sessions")[0] == 200  # the cookie logs in
        assert call(browser, f"{api}/sessions/{session.id}/stop", "POST", {"workers": [worker["id"]]})[0] == 403
        time.sleep(0.5)
        assert not ended(pid) and session.list_workers()[0]["status"] == "running"

        # Bad requests say what is wrong, and stop nothing.
        status, said = call(
            browser, f"{api}/sessions/{session.id}/stop", "POST", {"workers": "w0"}, {"X-XSRFToken": xsrf}
        )
        assert status == 400 and 'give "all" or a list of worker ids' in said["message"]
        status, said = call(
            browser, f"{api}/sessions/{session.id}/stop", "POST", {"workers": ["nope"]}, {"X-XSRFToken": xsrf}
        )
        assert status == 400 and "no worker 'nope'" in said["message"]
        assert call(browser, f"{api}/sessions/{'f' * 16}/stop", "POST", {}, {"X-XSRFToken": xsrf})[0] == 404

        # With it, the worker stops: through its session, which says so.
        status, said = call(
            browser, f"{api}/sessions/{session.id}/stop", "POST", {"workers": [worker["id"]]}, {"X-XSRFToken": xsrf}
        )
        assert (status, said) == (200, {"stopping": [worker["id"]]})
        deadline = time.monotonic() + 30
        while not ended(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(pid)
        while session.list_workers()[0]["status"] != "stopped" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session.list_workers()[0]["status"] == "stopped"

        # Logs: a worker's, bounded; nothing else.
        status, tail = call(browser, f"{api}/logs/{session.id}/{worker['id']}?bytes=4096")
        assert status == 200 and "worker up" in tail["text"]
        assert call(browser, f"{api}/logs/{session.id}/{worker['id']}?bytes=0")[0] == 400
        assert call(browser, f"{api}/logs/{session.id}/{worker['id']}?bytes=lots")[0] == 400
        status, said = call(browser, f"{api}/logs/{session.id}/{worker['id']}?bytes=%C2%B2")  # "²": a digit to str
        assert status == 400 and "give a number of bytes" in said["message"]
        assert call(browser, f"{api}/logs/{session.id}/{session.id}-7")[0] == 404
        for trick in (
            "..%2F..%2F..%2Fetc%2Fpasswd",
            f"{session.id}-0%2F..%2F..%2Fsession.json",
            "..",
            "%2Fetc%2Fpasswd",
        ):
            status, said = call(browser, f"{api}/logs/{session.id}/{trick}")
            assert status == 404 and "root:" not in json.dumps(said), trick

        status, done = call(browser, f"{api}/cleanup", "POST", {}, {"X-XSRFToken": xsrf})
        assert status == 200 and isinstance(done["done"], list)  # this session lives: nothing of it is ended
        assert not session.closed and session.list_workers()[0]["status"] == "stopped"
