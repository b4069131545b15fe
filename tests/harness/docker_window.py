"""Docker 20.10's window in its own firewall, for tests that check traffic is refused between networks.

Each time Docker creates a network it deletes FORWARD's jumps to DOCKER-USER and DOCKER-ISOLATION-STAGE-1
and inserts them again; in between, traffic between bridge networks (and on a bridge, past DOCKER-USER's
rules, where the stand-in cluster enforces NetworkPolicies) passes. A probe here saw both jumps missing for a
moment at each of 37 creations, none at removals. With two test processes, the other one makes networks at
any time (ci49: a dial between two sessions' networks got through once). A check of refused traffic runs
again when it got through while a network was created around it; never otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def refused_unless_in_dockers_window(client, attempt: Callable[[], T], got_through: Callable[[T], bool]) -> T:
    """attempt()'s result, tried again (at most 5 times) while it got through and a network was created on
    the engine (`client`, a docker-py client) within a second of it."""
    for _ in range(5):
        before = time.time()
        result = attempt()
        after = time.time()
        if not got_through(result):
            return result
        created = client.events(
            since=int(before) - 1, until=int(after) + 2, decode=True, filters={"type": "network", "event": "create"}
        )
        if not any(before - 1 <= event["timeNano"] / 1e9 <= after + 1 for event in created):
            return result  # nothing of Docker's explains it
    return result
