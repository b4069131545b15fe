"""A CML client, written against CML's documented worker API only, run unchanged on the local, Docker and
SSH backends: a web app on each worker's CDSW_APP_PORT, bound to 127.0.0.1 as CML's docs show it, reached
through its `app_url` (on Docker workers and SSH hosts through the agent's forwarder: apps/forward.py), and
stop_workers' responses checked, as Cloudera's cmlextensions does for its Ray and Dask dashboards. And what a notebook
gets: in a kernel of a Jupyter server with jupyter-server-proxy, `app_url` goes through that server, which
reaches a worker's address only while proxy_hosts.allow_workers admits it."""

from __future__ import annotations

import json
import os
import runpy
import secrets
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
from harness.fixtures import DOCKER_TEST_IMAGE, ssh_backend

from cmlcluster.apps import ports as app_ports

pytestmark = pytest.mark.integration

# What a worker serves on its CDSW_APP_PORT, in CML's documented form: on 127.0.0.1, where CML's engine proxy
# reaches it. Where the worker has an address of its own (a container, an SSH host), app_url names its agent's
# forwarder from that address to this port (docs/guide/cml.md).
APP = textwrap.dedent(
    """
    import http.server, os
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ('hello from ' + os.environ['CDSW_ENGINE_ID']).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
    port = int(os.environ['CDSW_APP_PORT'])
    assert os.environ['CDSW_READONLY_PORT'] and os.environ['CDSW_PUBLIC_PORT']
    http.server.HTTPServer(('127.0.0.1', port), Hello).serve_forever()
    """
)

# As a CML project would hold it.
CLIENT = f"APP = {APP!r}\n" + textwrap.dedent(
    """
    import inspect
    import time
    import urllib.request

    try:
        import cml.utils_v1 as utils

        cdsw = utils._emulate_cdsw()
    except ImportError:
        import cdsw

    import cml.workers_v1 as workers_v1

    args = {"n": 2, "cpu": 0.5, "memory": 0.5, "code": APP}
    if "name" in inspect.signature(cdsw.launch_workers).parameters:
        args["name"] = "Web App"
    launched = cdsw.launch_workers(**args)
    details = cdsw.await_workers(launched, wait_for_completion=False, timeout_seconds=90)
    assert len(details["workers"]) == 2, details
    for worker in details["workers"]:
        assert worker["name"] == "Web App"
        for attempt in range(100):
            try:
                with urllib.request.urlopen(worker["app_url"], timeout=5) as reply:
                    text = reply.read().decode()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("no answer at " + worker["app_url"])
        assert text == "hello from " + worker["id"], text  # CDSW_ENGINE_ID is the worker's id, as on CML
        print("fetched", worker["app_url"], worker["ip_address"], text)

    ids = [w["id"] for w in details["workers"]]
    responses = workers_v1.stop_workers(*ids)
    codes = [response.status_code for response in responses]
    assert len(codes) == 2 and all(code < 300 for code in codes) and all(r.ok for r in responses), codes
    print("stopped", codes)
    """
)

# Where no notebook server started this Python (a script, a console): the worker's own address.
NOT_IN_A_NOTEBOOK_SERVER = ("JUPYTERHUB_SERVICE_PREFIX", "JPY_PARENT_PID")
BACKEND_ENV = {
    "local": {"CMLCLUSTER_BACKEND": "local"},
    "docker": {
        "CMLCLUSTER_BACKEND": "docker",
        "CMLCLUSTER_DOCKER_IMAGE": DOCKER_TEST_IMAGE,
        "CMLCLUSTER_DOCKER_HOST_PYTHON": "1",
    },
}


def fetched(stdout):
    """[(app_url, ip_address)] of the client's "fetched" lines."""
    return [tuple(line.split()[1:3]) for line in stdout.splitlines() if line.startswith("fetched ")]


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_a_cml_client_reaches_its_workers_web_app_through_app_url_and_checks_stop_responses(tmp_path, backend):
    (tmp_path / "client.py").write_text(CLIENT)
    env = {k: v for k, v in os.environ.items() if k not in NOT_IN_A_NOTEBOOK_SERVER} | BACKEND_ENV[backend]
    # A fresh Python, as a CML session's: `cml` is there before cmlcluster is imported (cmlcluster-cml.pth).
    run = "import runpy; runpy.run_path('client.py', run_name='__main__'); import cmlcluster; cmlcluster.stop_session()"
    done = subprocess.run(
        [sys.executable, "-c", run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    apps = fetched(done.stdout)
    assert len(apps) == 2, done.stdout
    for url, ip in apps:
        if backend == "local":  # each its own free port on this machine's loopback
            assert ip == "127.0.0.1" and url.startswith("http://127.0.0.1:"), url
        else:  # each its own address, and the agent's forwarder to CML's fixed 8100 on its loopback
            assert not ip.startswith("127.") and url == f"http://{ip}:{app_ports.FORWARD_FIXED}/", url
    assert "stopped [200, 200]" in done.stdout


def test_the_same_client_on_ssh_hosts_reaches_each_app_at_its_hosts_address(ssh_hosts, tmp_path, capsys, monkeypatch):
    import cmlcluster

    for name in NOT_IN_A_NOTEBOOK_SERVER:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "client.py").write_text(CLIENT)
    cmlcluster.use_backend(ssh_backend(ssh_hosts))  # the default session the client's cml.workers_v1 uses
    runpy.run_path(str(tmp_path / "client.py"), run_name="__main__")
    cmlcluster.stop_session()
    out = capsys.readouterr().out
    hosts = {h.ip for h in ssh_hosts.hosts}
    apps = fetched(out)
    assert len(apps) == 2, out
    for url, ip in apps:
        # The host's address, and the port its forwarder was given (drawn free on the session's machine).
        assert ip in hosts and url.startswith(f"http://{ip}:") and url != f"http://{ip}:8100/", url
    assert "stopped [200, 200]" in out


# ------------------------------------------------------------------ through a notebook server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotebookServer:
    """`jupyter server` on 127.0.0.1 with jupyter-server-proxy, configured as docs/guide/cml.md says."""

    def __init__(self, folder, env):
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.runtime = folder / "runtime"
        config = folder / "config"
        config.mkdir()
        (config / "jupyter_server_config.py").write_text(
            "from cmlcluster.apps.proxy_hosts import allow_workers\nc.ServerProxy.host_allowlist = allow_workers\n"
        )
        env = env | {"JUPYTER_RUNTIME_DIR": str(self.runtime), "JUPYTER_CONFIG_DIR": str(config)}
        self.log = open(folder / "server.log", "w")  # closed by close()
        argv = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1"]
        argv += [f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--ServerApp.root_dir={folder}"]
        argv += [f"--IdentityProvider.token={self.token}", *(["--allow-root"] if os.geteuid() == 0 else [])]
        self.process = subprocess.Popen(argv, env=env, cwd=folder, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = folder / "server.log"
        deadline = time.monotonic() + 60
        while self.get("/api/status")[0] != 200:
            assert self.process.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.2)

    def request(self, path, method="GET", body=None):
        """(status, text) of a request to the server, authenticated as the browser's would be."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        request.add_header("Authorization", f"token {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except OSError as e:
            return 0, str(e)

    def get(self, path):
        return self.request(path)

    def kernel(self):
        """A client of a kernel the server started for a notebook, as JupyterLab's would be."""
        from jupyter_client import BlockingKernelClient

        status, text = self.request("/api/sessions", "POST", {"path": "app.ipynb", "type": "notebook", "kernel": {}})
        assert status == 201, text
        kernel_id = json.loads(text)["kernel"]["id"]
        client = BlockingKernelClient(connection_file=str(self.runtime / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        return client

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(30)  # it shuts its kernels down first
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def run_cell(client, code, timeout=180):
    out = []

    def hook(message):
        if message["msg_type"] == "stream":
            out.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            out.append("\n".join(message["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def test_a_notebook_opens_a_docker_workers_app_url_through_jupyter_server_proxy_while_it_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in NOT_IN_A_NOTEBOOK_SERVER} | BACKEND_ENV["docker"]
    server = NotebookServer(tmp_path, env)
    client = None
    try:
        client = server.kernel()
        cell = (
            "import cml.workers_v1 as workers\n"
            f"launched = workers.launch_workers(n=1, cpu=0.5, memory=0.5, code={APP!r})\n"
            "w = workers.await_workers(launched, wait_for_completion=False, timeout_seconds=120)['workers'][0]\n"
            "print(w['app_url'], w['ip_address'], w['id'])\n"
        )
        app_url, ip, worker_id = run_cell(client, cell).split()
        assert app_url == f"/proxy/{ip}:{app_ports.FORWARD_FIXED}/"  # the server's base URL is "/"

        deadline = time.monotonic() + 30
        while (answer := server.get(app_url))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.3)  # the app starts after the worker is up
        assert answer == (200, f"hello from {worker_id}"), answer
        # No other host: the allowlist admits running workers only.
        status, text = server.get("/proxy/10.255.255.1:8100/")
        assert status == 403 and "10.255.255.1" in text, (status, text)

        run_cell(client, f"assert workers.stop_workers({worker_id!r})[0].ok")
        deadline = time.monotonic() + 15
        while server.get(app_url)[0] != 403 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert server.get(app_url)[0] == 403  # stopped: its address is no longer admitted
        run_cell(client, "import cmlcluster; cmlcluster.stop_session()")
    finally:
        if client is not None:
            client.stop_channels()
        server.close()
