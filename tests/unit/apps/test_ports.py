"""CML's web-app fields, stop_workers' responses, name= and `cml.workers_v1`, on the fake backend.

What CML's docs and Cloudera's cmlextensions read: each worker dict's `app_url` (where a browser opens
what listens on the worker's CDSW_APP_PORT), CDSW_APP_PORT / CDSW_READONLY_PORT / CDSW_PUBLIC_PORT in
the worker, stop_workers returning one response per worker whose `status_code` callers check, and
name= found by inspect.signature.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import time

import pytest

import cmlcluster
from cmlcluster import ConfigError, Session
from cmlcluster.apps import ports as app_ports
from cmlcluster.apps import proxy_hosts, server_proxy
from cmlcluster.backends import Capabilities
from cmlcluster.backends.fake import FakeBackend, FakeWorker
from cmlcluster.backends.ssh.remote import short_tmpdir

PORT_NAMES = ("CDSW_APP_PORT", "CDSW_READONLY_PORT", "CDSW_PUBLIC_PORT")


def fake_session(*plan: FakeWorker, **options) -> Session:
    return Session(FakeBackend(list(plan), **options), echo=False)


def test_workers_with_an_address_of_their_own_get_cmls_ports_and_an_app_url_on_it(monkeypatch):
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    backend = FakeBackend([FakeWorker(), FakeWorker()])
    with Session(backend, echo=False) as s:
        workers = s.launch_workers(2, cpu=1, memory=1)
        assert [w["app_url"] for w in workers] == [None, None]  # no address yet
        running = s.await_workers(workers, wait_for_completion=False, timeout_seconds=10)["workers"]
        # Its agent's forwarder to its app on 127.0.0.1 (apps/forward.py), beside CDSW_APP_PORT.
        assert [w["app_url"] for w in running] == ["http://10.0.0.1:8101/", "http://10.0.0.2:8101/"]
        for handle in backend.handles.values():
            assert [handle.spec.env[name] for name in PORT_NAMES] == ["8100", "8090", "8080"]
            assert handle.spec.env["CMLCLUSTER_APP_FORWARD_PORT"] == "8101"


def test_workers_sharing_an_address_get_distinct_free_ports_each(monkeypatch):
    monkeypatch.delenv("JUPYTERHUB_SERVICE_PREFIX", raising=False)
    shared = Capabilities(own_address=False, session_host=False, python="python3", shared_paths=())
    backend = FakeBackend([FakeWorker(), FakeWorker()], capabilities=shared)
    with Session(backend, echo=False) as s:
        workers = s.await_workers(s.launch_workers(2, cpu=1, memory=1), False, 10)["workers"]
        names = (*PORT_NAMES, "CMLCLUSTER_APP_FORWARD_PORT")  # the last: its agent's forwarder's, app_url's
        ports = [[int(h.spec.env[name]) for name in names] for h in backend.handles.values()]
        assert len({p for each in ports for p in each}) == 8
        expected = [f"http://{w['ip_address']}:{p[3]}/" for w, p in zip(workers, ports, strict=True)]
        assert [w["app_url"] for w in workers] == expected


def test_app_url_goes_through_jupyter_server_proxy_under_jupyterhub(monkeypatch):
    monkeypatch.setattr(server_proxy, "installed", lambda: True)
    hub = {"JUPYTERHUB_SERVICE_PREFIX": "/user/ada/"}
    assert app_ports.app_url("127.0.0.1", 12345, hub) == "/user/ada/proxy/12345/"
    assert app_ports.app_url("10.0.0.7", 8100, hub) == "/user/ada/proxy/10.0.0.7:8100/"
    assert app_ports.app_url("fd00::7", 8100, hub) == "/user/ada/proxy/[fd00::7]:8100/"
    assert app_ports.app_url("10.0.0.7", 8100, {}) == "http://10.0.0.7:8100/"
    monkeypatch.setattr(server_proxy, "installed", lambda: False)
    assert app_ports.app_url("127.0.0.1", 12345, hub) == "http://127.0.0.1:12345/"  # no proxy to go through


def test_app_url_goes_through_the_jupyter_server_that_started_the_kernel(monkeypatch, tmp_path):
    """A kernel of a plain Jupyter server: its parent's jpserver-<pid>.json names the server's base URL."""
    monkeypatch.setattr(server_proxy, "installed", lambda: True)
    (tmp_path / "jpserver-4242.json").write_text('{"base_url": "/lab-here/", "port": 8888}')
    kernel = {"JPY_PARENT_PID": "4242", "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    assert app_ports.app_url("172.18.0.2", 8100, kernel) == "/lab-here/proxy/172.18.0.2:8100/"
    assert app_ports.app_url("127.0.0.1", 40123, kernel) == "/lab-here/proxy/40123/"
    # nbclient's and a console's kernels have a parent that is no server: the worker's own address.
    orphan = {"JPY_PARENT_PID": "4343", "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    assert app_ports.app_url("172.18.0.2", 8100, orphan) == "http://172.18.0.2:8100/"


def test_only_running_workers_of_live_sessions_are_admitted_to_the_proxy():
    with fake_session(FakeWorker(), FakeWorker()) as s:
        a, b = s.await_workers(s.launch_workers(2, cpu=1, memory=1), False, 10)["workers"]
        assert proxy_hosts.allow_workers(None, a["ip_address"]) and proxy_hosts.allow_workers(None, b["ip_address"])
        assert not proxy_hosts.allow_workers(None, "10.9.9.9")
        assert proxy_hosts.allow_workers(None, "localhost")  # jupyter-server-proxy's own default stays
        s.stop_workers(a)
        deadline = time.monotonic() + 10
        while proxy_hosts.allow_workers(None, a["ip_address"]) and time.monotonic() < deadline:
            time.sleep(0.05)  # the record is rewritten on the session's loop
        assert not proxy_hosts.allow_workers(None, a["ip_address"])
        assert proxy_hosts.allow_workers(None, b["ip_address"])
    assert not proxy_hosts.allow_workers(None, b["ip_address"])  # the session closed: its record is gone


def test_stop_workers_returns_one_response_per_worker_with_status_code_and_ok():
    with fake_session(FakeWorker(), FakeWorker()) as s:
        a, b = s.launch_workers(2, cpu=1, memory=1)
        s.await_workers([a, b], wait_for_completion=False, timeout_seconds=10)
        responses = s.stop_workers(a["id"], b)
        assert [r.status_code for r in responses] == [200, 200]
        assert all(r.ok for r in responses)
        assert [r["id"] for r in responses] == [a["id"], b["id"]]  # each is also the worker's dict
        assert [r.json()["status"] for r in responses] == ["stopped", "stopped"]
        again = s.stop_workers()  # already stopped: still 200, as a second DELETE of an ended engine
        assert [r.status_code for r in again] == [200, 200]


def test_stop_workers_says_500_for_a_worker_that_did_not_end():
    from cmlcluster.workers import StopResponse

    response = StopResponse({"id": "s-1", "status": "running"})
    assert (response.status_code, response.ok) == (500, False)
    with pytest.raises(cmlcluster.WorkerError, match="s-1 is still running"):
        response.raise_for_status()


def test_name_is_accepted_found_by_signature_and_shown():
    assert "name" in inspect.signature(cmlcluster.launch_workers).parameters  # how cmlextensions asks
    assert "name" in inspect.signature(Session.launch_workers).parameters
    with fake_session(FakeWorker()) as s:
        [w] = s.launch_workers(1, cpu=1, memory=1, name="Ray Head")
        assert w["name"] == "Ray Head"
        assert [x["name"] for x in s.list_workers()] == ["Ray Head"]
        [unnamed] = s.launch_workers(1, cpu=1, memory=1)
        assert unnamed["name"] == ""


def test_a_name_that_is_not_one_line_of_text_is_refused_before_anything_starts():
    backend = FakeBackend([FakeWorker()])
    with Session(backend, echo=False) as s:
        for bad in (3, "a\nb", "x" * 201):
            with pytest.raises(ConfigError, match="name="):
                s.launch_workers(1, cpu=1, memory=1, name=bad)
        assert backend.handles == {}


def test_cml_workers_v1_and_utils_v1_are_cmlclusters_api_where_no_real_cml_is_installed():
    code = (
        "import cmlcluster, cml.workers_v1 as w, cml.utils_v1 as u; cdsw = u._emulate_cdsw();"
        "import cmlcluster.api as api;"
        "assert w.launch_workers is api.launch_workers and w.stop_workers is api.stop_workers;"
        "assert cdsw.await_workers is api.await_workers and cdsw.list_workers is api.list_workers"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_real_cml_wins_over_cmlclusters(tmp_path):
    (tmp_path / "cml").mkdir()
    (tmp_path / "cml" / "__init__.py").write_text("REAL = True\n")
    code = "import cmlcluster, cml; assert cml.REAL, cml.__file__"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=_with_path(tmp_path))


def _with_path(folder) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def test_an_ssh_workers_tmpdir_leaves_room_for_rays_sockets():
    import os
    import shutil

    folder = short_tmpdir()
    try:
        ray_socket = "/ray/session_2024-01-01_00-00-00_000000_1234567/sockets/plasma_store"
        assert len(folder + ray_socket) <= 107, folder
        assert os.stat(folder).st_mode & 0o077 == 0
    finally:
        shutil.rmtree(folder)


def test_cml_shim_is_not_imported_eagerly():
    # The finder is installed by `import cmlcluster`; `cml` itself is imported only when asked for.
    importlib.import_module("cmlcluster")
    assert "cml" not in sys.modules or sys.modules["cml"].__file__


def test_the_proxy_never_waits_on_the_controller_of_a_gone_sessions_record(monkeypatch, tmp_path):
    """jupyter-server-proxy asks on the notebook server's loop, for every request: a record a killed session
    left must cost a file read, not a connection to its controller (a second's timeout each)."""
    import json

    from cmlcluster import origin, records

    monkeypatch.setenv("CMLCLUSTER_STATE_DIR", str(tmp_path / "state"))  # this test's records only
    gone = {
        "id": "0123456789abcdef",
        "pid": 1,
        "origin": {**origin.this_process().as_strings(), "pid": "999999999", "start": "0"},
        "controller": "10.255.255.1:9",  # would hang until the probe's timeout
        "workers": [{"id": "0123456789abcdef-0", "status": "running", "ip_address": "172.30.0.9"}],
    }
    with open(os.path.join(records.folder(), "0123456789abcdef.json"), "w") as f:
        json.dump(gone, f)

    def connect(*args, **kwargs):
        raise AssertionError("the proxy connected to a controller")

    monkeypatch.setattr(origin.socket, "create_connection", connect)
    assert not proxy_hosts.allow_workers(None, "172.30.0.9")  # its process is gone: not admitted
