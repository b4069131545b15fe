"""ipykernel's private API, in one place: acting on a widget's message while a cell holds the kernel.

A widget's messages are comm messages on the shell channel: they wait behind the cell that runs.
ipykernel 7 (with kernel subshells) reads every shell message on a thread of its own and, for a comm
message, asks the comm which subshell handles it: `comm._reply_subshell_for(data, default)` in
Kernel.shell_channel_thread_main, on that thread, before the message queues. Wrapping that method on
one comm lets its messages act at once, whatever the main thread runs; routing is left unchanged, so the
message is handled as usual afterwards too. Where a probe finds otherwise (ipykernel 6, another kernel),
nothing is hooked and the caller says that the cell stops with Interrupt (■).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from .. import probes
from .shell import ipython

log = logging.getLogger("cmlcluster")


def on_arrival(comm: Any, act: Callable[[Any], None]) -> bool:
    """Call `act(data)` with each message of `comm` as it reaches the kernel, on ipykernel's shell-channel
    thread, before it waits behind a running cell. `act` must only schedule work: it holds up every shell
    message behind it. Returns False (nothing hooked) where the running kernel cannot do this."""
    missing = probes.missing(_checks(comm))
    if missing:
        log.debug("cmlcluster: the Stop button acts between cells only; this kernel lacks: %s", "; ".join(missing))
        return False
    route = comm._reply_subshell_for

    def arrived(data: Any, default: Any) -> Any:
        try:
            act(data)
        except Exception:  # never lose the message over it: ipykernel would drop it as invalid
            log.exception("cmlcluster: acting on a widget message")
        return route(data, default)

    comm._reply_subshell_for = arrived
    return True


def _checks(comm: Any) -> list[probes.Check]:
    kernel: Any = getattr(ipython(), "kernel", None)
    return [
        ("a kernel with a shell-channel thread (ipykernel 7)", lambda: kernel.shell_channel_thread is not None),
        (
            "Kernel.shell_channel_thread_main asks comm._reply_subshell_for",
            lambda: "_reply_subshell_for" in inspect.getsource(type(kernel).shell_channel_thread_main),
        ),
        ("comm._reply_subshell_for(data, default)", lambda: _takes_data_and_default(comm._reply_subshell_for)),
    ]


def _takes_data_and_default(method: Any) -> bool:
    return list(inspect.signature(method).parameters) == ["data", "default"]
