"""No log of a session holds its secrets, at whatever level (cmlcluster/_redact.py): with
CMLCLUSTER_LOG_LEVEL=DEBUG ipyparallel's controller logs the hub's connection info and an engine its
configuration, the signing key in both; the controller's log and the worker's kept log must not."""

from __future__ import annotations

import glob
import logging
import os

import pytest

from cmlcluster import Session
from cmlcluster.control import connection

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_session_at_debug_writes_no_signing_or_curve_secret_key_into_any_log(monkeypatch, caplog):
    monkeypatch.setenv("CMLCLUSTER_LOG_LEVEL", "DEBUG")
    made: list[connection.Keys] = []
    new = connection.Keys.new

    def recorded() -> connection.Keys:
        made.append(new())
        return made[-1]

    monkeypatch.setattr(connection.Keys, "new", recorded)
    with caplog.at_level(logging.DEBUG), Session("local", echo=False) as s:
        [w] = s.launch_workers(1, cpu=0.5, memory=0.5, code="print('the program ran')")
        s.drain(10)
        # Every file the session and its worker wrote but the connection files (0600, made to hold the keys).
        security = os.path.join(s.session_dir, "ipython", "security")
        written = [
            p
            for p in glob.glob(os.path.join(s.session_dir, "**"), recursive=True)
            if os.path.isfile(p) and not p.startswith(security)
        ]
        written += glob.glob(os.path.join(s.log_folder, "*"))
        logs = {p: open(p, errors="replace").read() for p in written}
    [keys] = made
    assert keys.signing and keys.curve_secret
    controller = logs[os.path.join(s.session_dir, "controller.log")]
    assert "Hub engine addrs" in controller  # the DEBUG lines were written
    assert "Config changed" in logs[s.worker_log_path(w)]
    for path, text in [*logs.items(), ("the session's own log records", caplog.text)]:
        for secret in (keys.signing, keys.curve_secret):
            assert secret not in text, path
    assert "'key': '[secret]'" in controller
