"""What every test, unit or not, may use and leaves as it found it (a pytest plugin, loaded by
tests/conftest.py): a real IPython shell; this process's signal handlers, and no default session."""

from __future__ import annotations

import signal
import sys

import pytest

SIGNALS_A_TEST_MUST_LEAVE = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def signal_handlers_as_found(request):
    """A test leaves this process's signal handlers as it found them: a handler left behind changes what
    Ctrl-C and the widget's Stop do in every later test of this xdist worker (the Stop tests met one,
    left by asyncio in test_notebooks). Put back, so that later tests are not affected, and failed."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS_A_TEST_MUST_LEAVE}
    yield
    changed = {sig: signal.getsignal(sig) for sig, h in before.items() if signal.getsignal(sig) is not h}
    for sig in changed:
        signal.signal(sig, before[sig])
    left = ", ".join(f"{signal.Signals(s).name} {h!r} (was {before[s]!r})" for s, h in changed.items())
    assert not changed, f"the test left signal handlers changed: {left}"


@pytest.fixture(autouse=True)
def default_session_as_found(request):
    """After each test, no default session and no backend choice: a test's use_backend (or run_horovod's
    reuse=True, which makes one) must not follow the next test in this process. Set up after the leak
    checks (it takes them, where they are loaded), so torn down before them: the default session's workers
    are the test's."""
    for check in ("no_leaked_containers", "no_leaked_processes", "no_leaked_temp_folders"):
        if check in request.fixturenames:
            request.getfixturevalue(check)
    yield
    api = sys.modules.get("cmlcluster.api")
    if api is not None and (api._default is not None or api._backend is not None):
        api.stop_session()
        api.use_backend(None)


@pytest.fixture
def shell():
    """A real IPython shell with cmlcluster's magics loaded (the default session it uses is stopped
    afterwards: default_session_as_found)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "cmlcluster")
    return ip
