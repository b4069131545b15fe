"""Secrets out of every log record of a process (cmlcluster/_redact.py), as the controller and the agent
install it: whatever logger, level, argument type, traceback."""

from __future__ import annotations

import logging

import pytest

from cmlcluster import _redact

KEY = "8293cf4222d875d29cf9c08c5135d144"


@pytest.fixture
def hidden(monkeypatch):
    # The process's record factory and the module's state come back after the test.
    monkeypatch.setattr(_redact, "_secrets", set())
    monkeypatch.setattr(_redact, "_installed", False)
    factory = logging.getLogRecordFactory()
    yield _redact.hide
    logging.setLogRecordFactory(factory)


def test_a_hidden_key_leaves_no_record_in_its_message_arguments_or_traceback(hidden, caplog):
    hidden(KEY.encode(), "", None)
    log = logging.getLogger("ipyparallel.somewhere.deep")
    with caplog.at_level(logging.DEBUG):
        log.debug("Hub engine addrs: %s", {"key": KEY, "registration": 1})
        log.debug("Config changed: %r", {"Session": {"key": KEY.encode()}})
        try:
            raise ValueError(f"bad key {KEY}")
        except ValueError:
            log.exception("failed")
        log.warning("%s %s", KEY)  # arguments that do not fit: logging's error report would print them
    assert KEY not in caplog.text
    assert caplog.text.count("[secret]") == 4
    assert "'registration': 1" in caplog.text
