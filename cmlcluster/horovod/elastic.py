"""The hosts an elastic horovodrun may use, as its --host-discovery-script prints them.

horovodrun runs the script every second (horovod.runner.elastic.driver): a host that leaves the
list loses its ranks' slots, a host that joins gets ranks, and training waits while fewer than
--min-np slots are listed. The list lives in a 0600 file that this module rewrites whole and
atomically (a temporary file, then os.replace), so that the script never prints half a list;
the script only prints the file.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
import threading
from collections.abc import Iterator

from . import commands


class DiscoveryFile:
    """A host list and the 0700 script that prints it, in a private folder of `parent`; close() removes them."""

    def __init__(self, parent: str | None = None):
        self.folder = tempfile.mkdtemp(prefix="horovod-hosts-", dir=parent)
        self.path = os.path.join(self.folder, "hosts")
        self.script = os.path.join(self.folder, "discover_hosts.sh")
        self._hosts: dict[str, int] = {}
        self._lock = threading.Lock()  # the job's threads change it
        self._write()
        with open(os.open(self.script, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700), "w") as f:
            f.write(f"#!/bin/sh\nexec cat {shlex.quote(self.path)}\n")

    @property
    def hosts(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._hosts.items())

    def set(self, hosts: commands.Hosts) -> None:
        with self._lock:
            self._hosts = dict(commands.check_hosts(hosts))
            self._write()

    def _write(self) -> None:
        text = commands.discovery_text(list(self._hosts.items()))
        fd, tmp = tempfile.mkstemp(prefix=".hosts-", dir=self.folder)  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)  # the script prints the old list or the new one, never a part
        except BaseException:
            os.unlink(tmp)
            raise

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def discovery(parent: str | None, hosts: commands.Hosts, max_restarts: int) -> Iterator[DiscoveryFile | None]:
    """An elastic local run's host list, in `parent` (None for a static run); removed when the run ends."""
    if not max_restarts:
        yield None
        return
    found = DiscoveryFile(parent=parent)
    try:
        found.set(hosts)
        yield found
    finally:
        found.close()
