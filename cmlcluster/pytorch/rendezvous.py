"""An elastic run's rendezvous: torchrun's c10d one, with its state signed, so that no one else's bytes are unpickled.

torch keeps the rendezvous state in the store as a pickle, under ``torch.rendezvous.<run id>``, and every
node's agent unpickles what it finds there at each sync (DynamicRendezvousHandler's state holder). The
store has no authentication: anyone who reaches its port may SET any key, and LIST_KEYS names them all,
so no secret run id keeps that key from a stranger. Here each node signs the state it writes with the
run's key (HMAC-SHA256; the key reaches the node through its environment, never a command line or the
store) and unpickles only a state signed with it.

A stranger's value in torch's key must not cost the run its newest state either: putting back a node's own
last state can roll the rendezvous back past a join that another node has already acted on (two nodes then
wait for each other's rank information until the store times out). So every change of membership (who
takes part, the round, its deadline: everything in the state but the heartbeats) is numbered, an *epoch*,
and written first to a write-once key of its own, ``torch.rendezvous.<run id>/membership/<epoch>``, with the
store's compare-and-set from "absent": whoever claims that key made the change, and no one can make another
one at that epoch. torch's key then carries the newest state, heartbeats included, as torch's own backend's
does. A node that finds a value it cannot verify there reads the newest membership from the epoch keys
(they only grow: one per join, leave or round, not one per heartbeat), and the node that holds that epoch's
latest state puts it back; a node that holds only the epoch key's copy, whose heartbeats may be old, waits
for it. What a stranger can still do, by writing the store over and over, is stop the run: never make a node
read what this run did not sign.

launch.py registers the backend with torchrun (``--rdzv-backend cmlcluster``, torch's public handler
registry) in its own process. torch is imported when the backend is made.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import logging
import os
import pickle
import struct
from base64 import b64decode, b64encode
from typing import Any

BACKEND = "cmlcluster"  # torchrun's --rdzv-backend
KEY_ENV = "CMLCLUSTER_RDZV_KEY"  # the run's signing key, hex; taken out of the environment by launch.py
RUN_ID_ENV = "PET_RDZV_ID"  # torchrun's --rdzv-id, read from the environment by torch's own parser
# torch's C10dRendezvousBackend writes this for "no state yet"; the same here, so that both read one key alike.
NULL_STATE = b"Y2FuaW1hZGFt"
MAC_BYTES = hashlib.sha256().digest_size
EPOCH = struct.Struct(">Q")
RESTORE_ATTEMPTS = 5  # a stranger who keeps writing: the sync fails after this many put-backs in a row

log = logging.getLogger(__name__)


def sign(key: bytes, name: str, epoch: int, state: bytes) -> bytes:
    """The stored form of `state` at membership `epoch` under the store key `name`: base64(HMAC || epoch || state)."""
    body = EPOCH.pack(epoch) + state
    return b64encode(_mac(key, name, body) + body)


def verified(key: bytes, name: str, value: bytes) -> tuple[int, bytes] | None:
    """(epoch, state) of a stored value signed with `key` for `name`; None for anything else."""
    try:
        raw = b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    mac, body = raw[:MAC_BYTES], raw[MAC_BYTES:]
    if len(body) < EPOCH.size or not hmac.compare_digest(mac, _mac(key, name, body)):
        return None
    return EPOCH.unpack_from(body)[0], body[EPOCH.size :]


def _mac(key: bytes, name: str, body: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).digest()


def membership(state: bytes) -> Any:
    """What of a torch rendezvous state is not a heartbeat: equal for two states that differ only in heartbeats.

    Only states from this process's torch or signed with the run's key get here, so unpickling is safe.
    Anything that is not torch's state is its own bytes: every change of it is a change of membership.
    """
    try:
        fields = dict(vars(pickle.loads(state)))  # noqa: S301 (signed by this run, or torch's own)
        del fields["last_heartbeats"]
    except Exception:  # not torch's _RendezvousState (another torch, or a test's bytes): compare it whole
        return state
    return fields


def signed_backend(store: Any, run_id: str, key: bytes) -> Any:
    """A torch RendezvousBackend over `store` whose state is signed with `key` (see the module's docstring).

    Made here, where torch is imported: its base class is torch's.
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    name = "torch.rendezvous." + run_id

    def epoch_key(epoch: int) -> str:
        return f"{name}/membership/{epoch}"

    class SignedBackend(RendezvousBackend):
        """torch's C10dRendezvousBackend (get_state, and set_state as compare-and-set on one key), signed."""

        def __init__(self) -> None:
            self._store = store
            # The newest value of torch's key that this node read there or wrote: its heartbeats are current.
            self._known: tuple[int, bytes] = (0, NULL_STATE)
            self._forgery = b""  # the last unsigned value warned about: a stranger's value is reported once
            self._call("compare_set", name, "", NULL_STATE)

        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self) -> tuple[bytes, Any] | None:
            return self._latest(self._call("get", name))

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            if token and not isinstance(token, bytes):  # not one of ours: say what is there, as torch's does
                current = self.get_state()
                return None if current is None else (*current, False)
            expected = token if token else NULL_STATE
            before = self._signed(expected)
            epoch = self._epoch(expected)
            if before is not None and membership(before[1]) == membership(state):
                value = sign(key, name, epoch, state)  # heartbeats only: the same epoch, torch's compare-and-set
                now = self._call("compare_set", name, expected, value)
            else:
                value = sign(key, name, epoch + 1, state)
                now = self._call("get", name)
                if now == expected:  # the state this change was made from is still the newest: claim the epoch
                    claimed = self._call("compare_set", epoch_key(epoch + 1), "", value)
                    now = self._publish(expected, value) if claimed == value else self._call("get", name)
            if now == value:
                self._known = self._epoch(value), value
                return state, value, True
            current = self._latest(now)
            return None if current is None else (*current, False)

        def _publish(self, expected: bytes, value: bytes) -> bytes:
            """Put the epoch this node claimed into torch's key, over anything older there (or a stranger's)."""
            epoch = self._epoch(value)
            current = expected
            for _ in range(RESTORE_ATTEMPTS):
                now = self._call("compare_set", name, current, value)
                if now == value or self._epoch(now) > epoch:  # ours, or already built upon
                    return value
                current = now
            raise RendezvousStateError(
                f"the rendezvous state was overwritten {RESTORE_ATTEMPTS} times in a row by someone who does "
                "not hold this run's key"
            )

        def _latest(self, value: bytes) -> tuple[bytes, bytes] | None:
            """(state, token) of the newest state, from torch's key `value`, the epoch keys and what this node knows."""
            for _ in range(RESTORE_ATTEMPTS):
                epoch, newest = self._frontier(value)
                if newest == value:
                    return self._reply(value)
                # torch's key holds a stranger's value or an older epoch. Put back the newest state only if this
                # node holds it with current heartbeats (the node that made the epoch, or read it since);
                # another node's would be the epoch key's copy, heartbeats as old as the epoch.
                if epoch and self._known[0] != epoch:
                    return self._reply(newest)
                restore = self._known[1] if epoch else NULL_STATE
                now = self._call("compare_set", name, value, restore)
                if now == restore:
                    return self._reply(restore)
                value = now  # torch's key changed meanwhile: look again
            raise RendezvousStateError(
                f"the rendezvous state was overwritten {RESTORE_ATTEMPTS} times in a row by someone who does "
                "not hold this run's key"
            )

        def _frontier(self, value: bytes) -> tuple[int, bytes]:
            """The newest epoch and its newest value: torch's key if it is signed and no older, else an epoch key's."""
            epoch, newest = self._known
            if value != NULL_STATE:
                found = verified(key, name, value)
                if found is None:
                    self._warn(value)
                elif found[0] >= epoch:
                    epoch, newest = self._known = found[0], value
            elif epoch == 0:
                newest = value
            # A membership change is claimed before torch's key shows it: an epoch key may be newer.
            while self._call("check", [epoch_key(epoch + 1)]):
                epoch += 1
                newest = self._call("get", epoch_key(epoch))
                if self._epoch(newest) != epoch:
                    raise RendezvousStateError(
                        f"the rendezvous store's membership epoch {epoch} holds a value this run did not sign: "
                        "someone else reached the store, and the rendezvous cannot go on without it"
                    )
            return epoch, newest

        def _signed(self, value: bytes) -> tuple[int, bytes] | None:
            """(epoch, state) of a value signed with the run's key; None for "no state yet" or anything else."""
            return None if value == NULL_STATE else verified(key, name, value)

        def _epoch(self, value: bytes) -> int:
            found = self._signed(value)
            return 0 if found is None else found[0]

        def _reply(self, value: bytes) -> tuple[bytes, bytes] | None:
            """torch's (state, token) for a signed value; None for "no state yet"."""
            found = self._signed(value)
            return None if found is None else (found[1], value)

        def _warn(self, value: bytes) -> None:
            if value != self._forgery:
                self._forgery = value
                log.warning(  # the key's name is not said: it holds the run id, which stays out of logs
                    "cmlcluster: the rendezvous store held a state this run did not sign (%d bytes): someone "
                    "else reached the store. It was not read; the newest signed state is put back",
                    len(value),
                )

        def _call(self, op: str, *args: Any) -> Any:
            try:
                return getattr(self._store, op)(*args)
            except (ValueError, RuntimeError, TimeoutError) as e:
                raise RendezvousConnectionError(f"the rendezvous store failed ({op}): {e}") from e

    return SignedBackend()


def register(key: bytes) -> None:
    """Make ``--rdzv-backend cmlcluster`` torch's c10d rendezvous (its store, its settings) with signed state."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    def create(params: RendezvousParameters) -> Any:
        _, store = create_backend(params)  # torch's own TCPStore client, from --rdzv-endpoint and --rdzv-conf
        return create_handler(store, signed_backend(store, params.run_id, key), params)

    rendezvous_handler_registry.register(BACKEND, create)


def take_key() -> bytes | None:
    """The run's signing key, out of this process's environment (the ranks it starts never see it)."""
    value = os.environ.pop(KEY_ENV, "")
    return bytes.fromhex(value) if value else None
