"""Process hygiene: ending a worker's whole process group."""

from __future__ import annotations

import os


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False if nothing is left in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
