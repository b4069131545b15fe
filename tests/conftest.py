"""What a test run owns, and the plugins that check it (tests/harness).

A run owns only what it starts: its tag, state folder and temp folder (harness/identity.py, set here
first, before any test module or session reads them). Every test leaves this process's signal handlers
and the default session as it found them (harness/isolation.py). A run with more than the unit tier also
loads the integration harness: the run-wide hooks (harness/run.py: the bystander, the subreaper, the end's
sweep), the leak checks after each test (harness/leaks.py) and the fixtures that tests run on
(harness/fixtures.py: backends, sessions, SSH hosts, the stand-in Kubernetes cluster). The unit tier,
alone (`pytest tests/unit`), imports none of it.
"""

from __future__ import annotations

import os

from harness import identity  # noqa: F401  # the run's tag and folders, before anything reads them

UNIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit")
INTEGRATION_PLUGINS = ("harness.run", "harness.leaks", "harness.fixtures")


def unit_only(args: list[str]) -> bool:
    """Whether every path the run was given lies in tests/unit (the node ids' files included)."""
    paths = [os.path.abspath(arg.split("::")[0]) for arg in args if not arg.startswith("-")]
    return bool(paths) and all(path == UNIT or path.startswith(UNIT + os.sep) for path in paths)


def pytest_configure(config):
    config.pluginmanager.import_plugin("harness.isolation")
    if not unit_only(config.args):
        for plugin in INTEGRATION_PLUGINS:
            config.pluginmanager.import_plugin(plugin)
