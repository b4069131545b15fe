"""The checks every entry point makes of a user's numbers, in one place.

Each caller words its own error (the bad value, the parameter and the fix); these
only say whether a value is acceptable. A bool is never a number here, though
Python's bool is an int: `n_workers=True` is a mistake, not 1.
"""

from __future__ import annotations

import math
import re


def whole(value: object, low: int | None = None, high: int | None = None) -> bool:
    """Whether `value` is an int (not a bool) with low <= value <= high (None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def number(value: object, *, low: float | None = None, above: float | None = None) -> bool:
    """Whether `value` is a finite int or float (not a bool), >= low and > above (None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (low is None or value >= low) and (above is None or value > above)


def port(value: object) -> bool:
    """Whether `value` is a TCP port number one can connect to (1-65535)."""
    return whole(value, 1, 65535)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A host as ssh, horovodrun's -H and a hostfile take it: a name, an IPv4 address or a bare IPv6 one.
_HOST = re.compile(r"[A-Za-z0-9_.%:][A-Za-z0-9_.%:-]*")
# A network interface's name as Linux gives it (15 characters at most) and as horovodrun passes it on:
# unquoted, in the shell command that starts each rank (HOROVOD_GLOO_IFACE=<name>), so no shell characters.
_INTERFACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,14}")


def env_name(value: object) -> bool:
    """Whether `value` is a variable name every shell and `env` take as one (POSIX: [A-Za-z_][A-Za-z0-9_]*)."""
    return isinstance(value, str) and _ENV_NAME.fullmatch(value) is not None


def interface_name(value: object) -> bool:
    """Whether `value` is a network interface name ("eth0", "ens5", "ib0", "eth0:1") that a shell takes as
    one word: 1 to 15 of letters, digits, '_', '.', ':', '-', not starting with '-', '.' or ':'."""
    return isinstance(value, str) and _INTERFACE.fullmatch(value) is not None


def host(value: object) -> bool:
    """Whether `value` is a host ssh cannot read as anything else: no leading '-' (an option),
    no brackets, whitespace, commas, '@' or shell characters; letters, digits, '.', '_', '-', ':', '%'."""
    return isinstance(value, str) and _HOST.fullmatch(value) is not None
