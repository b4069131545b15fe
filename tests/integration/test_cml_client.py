"""A CML client, written against CML's documented worker API only, run unchanged on the local backend:
a web app on a worker's CDSW_APP_PORT reached through its `app_url`, and stop_workers' responses checked,
as Cloudera's cmlextensions does for its Ray and Dask dashboards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

# As a CML project would hold it. It binds localhost, as CML's docs say an app on CDSW_APP_PORT should.
CLIENT = textwrap.dedent(
    """
    import inspect
    import urllib.request

    try:
        import cml.utils_v1 as utils

        cdsw = utils._emulate_cdsw()
    except ImportError:
        import cdsw

    import cml.workers_v1 as workers_v1

    app = (
        "import http.server, os\\n"
        "class Hello(http.server.BaseHTTPRequestHandler):\\n"
        "    def do_GET(self):\\n"
        "        body = ('hello from ' + os.environ['CDSW_ENGINE_ID']).encode()\\n"
        "        self.send_response(200)\\n"
        "        self.end_headers()\\n"
        "        self.wfile.write(body)\\n"
        "port = int(os.environ['CDSW_APP_PORT'])\\n"
        "assert os.environ['CDSW_READONLY_PORT'] and os.environ['CDSW_PUBLIC_PORT']\\n"
        "http.server.HTTPServer(('127.0.0.1', port), Hello).serve_forever()\\n"
    )
    args = {"n": 2, "cpu": 0.5, "memory": 0.5, "code": app}
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
                import time

                time.sleep(0.2)
        else:
            raise AssertionError("no answer at " + worker["app_url"])
        assert text.startswith("hello from "), text
        print("fetched", worker["app_url"], text)

    ids = [w["id"] for w in details["workers"]]
    responses = workers_v1.stop_workers(*ids)
    codes = [response.status_code for response in responses]
    assert len(codes) == 2 and all(code < 300 for code in codes) and all(r.ok for r in responses), codes
    print("stopped", codes)
    """
)


def test_a_cml_client_reaches_its_workers_web_app_through_app_url_and_checks_stop_responses(tmp_path):
    (tmp_path / "client.py").write_text(CLIENT)
    env = {**os.environ, "CMLCLUSTER_BACKEND": "local"}
    env.pop("JUPYTERHUB_SERVICE_PREFIX", None)
    # The notebook has imported cmlcluster (which answers for `cml` where no real CML is installed).
    run = "import cmlcluster, runpy; runpy.run_path('client.py', run_name='__main__'); cmlcluster.stop_session()"
    done = subprocess.run(
        [sys.executable, "-c", run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("fetched http://127.0.0.1:") == 2
    assert "stopped [200, 200]" in done.stdout
