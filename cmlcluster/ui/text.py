"""Worker output as prefixed lines on the session's own stdout/stderr."""

from __future__ import annotations

import sys

from ..session import Event


class OutputPrinter:
    """Prints each output line of each worker as ``[worker-id] line``."""

    def __call__(self, event: Event) -> None:
        if event.kind != "output":
            return
        stream = sys.stderr if event.stream == "stderr" else sys.stdout
        print(f"[{event.worker['id']}] {event.text}", file=stream, flush=True)
