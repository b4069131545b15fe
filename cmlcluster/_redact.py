"""Secrets kept out of a process's log lines, whoever logs them and at whatever level.

At DEBUG (CMLCLUSTER_LOG_LEVEL=DEBUG) ipyparallel's controller logs the hub's connection info with the
session's signing key in it ("Hub engine addrs: {... 'key': ...}"), and an engine logs its whole
configuration, Session.key included ("Config changed: ..."). Those lines go into the controller's log
and into the worker's log, which is kept after the session. Whoever reads the key can sign messages
that run code in every worker, so the processes that hold it call hide() with their secrets before
they log anything: every log record made in the process afterwards has them replaced by [secret],
whichever logger made it and whatever handler writes it (a record factory, not a filter on handlers
that a library may add later).
"""

from __future__ import annotations

import logging
from typing import Any

REPLACEMENT = "[secret]"

_secrets: set[str] = set()
_installed = False


def hide(*secrets: str | bytes | None) -> None:
    """From now on, replace each of `secrets` (empty ones are ignored) in this process's log records."""
    global _installed
    new = {s.decode("ascii", "replace") if isinstance(s, bytes) else s for s in secrets if s}
    if not new:
        return
    _secrets.update(new)
    if not _installed:
        _installed = True
        make = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return _redacted(make(*args, **kwargs))

        logging.setLogRecordFactory(factory)


def redact(text: str) -> str:
    for secret in _secrets:
        text = text.replace(secret, REPLACEMENT)
    return text


def _redacted(record: logging.LogRecord) -> logging.LogRecord:
    # The message is formatted here, once (a record is made only for a level that is logged), so that no
    # handler formats it again from its arguments; so are a traceback and a stack, which may quote the key.
    try:
        message = record.getMessage()
    except Exception:  # arguments that do not fit the message: logging's own error report would print them
        message = f"{record.msg} {record.args!r}"
    record.msg, record.args = redact(message), ()
    if record.exc_info:
        record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record
