"""An elastic run's rendezvous: torchrun's c10d one, with its state signed, so that no one else's bytes are unpickled.

torch keeps the rendezvous state in the store as a pickle, under ``torch.rendezvous.<run id>``, and every
node's agent unpickles what it finds there at each sync (DynamicRendezvousHandler's state holder). The
store has no authentication: anyone who reaches its port may SET any key, and LIST_KEYS names them all,
so no secret run id keeps that key from a stranger. Here each node signs the state it writes with the
run's key (HMAC-SHA256; the key reaches the node through its environment, never a command line or the
store) and unpickles only a state signed with it. A value that is not (a stranger's) is never unpickled:
it is put back to this node's last signed state (or to "no state yet"), with a warning, and the run goes on.

launch.py registers the backend with torchrun (``--rdzv-backend cmlcluster``, torch's public handler
registry) in its own process. torch is imported when the backend is made.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import logging
import os
from base64 import b64decode, b64encode
from typing import Any

BACKEND = "cmlcluster"  # torchrun's --rdzv-backend
KEY_ENV = "CMLCLUSTER_RDZV_KEY"  # the run's signing key, hex; taken out of the environment by launch.py
RUN_ID_ENV = "PET_RDZV_ID"  # torchrun's --rdzv-id, read from the environment by torch's own parser
# torch's C10dRendezvousBackend writes this for "no state yet"; the same here, so that both read one key alike.
NULL_STATE = "Y2FuaW1hZGFt"
MAC_BYTES = hashlib.sha256().digest_size
RESTORE_ATTEMPTS = 5  # a stranger who keeps writing: the sync fails after this many put-backs in a row

log = logging.getLogger(__name__)


def sign(key: bytes, name: str, state: bytes) -> bytes:
    """The stored form of `state` under the store key `name`: base64(HMAC || state), ASCII as torch's own."""
    return b64encode(_mac(key, name, state) + state)


def verified(key: bytes, name: str, value: bytes) -> bytes | None:
    """The state inside a stored value signed with `key` for `name`; None for anything else."""
    try:
        raw = b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    mac, state = raw[:MAC_BYTES], raw[MAC_BYTES:]
    if len(raw) <= MAC_BYTES or not hmac.compare_digest(mac, _mac(key, name, state)):
        return None
    return state


def _mac(key: bytes, name: str, state: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + state, hashlib.sha256).digest()


def signed_backend(store: Any, run_id: str, key: bytes) -> Any:
    """A torch RendezvousBackend over `store` whose state is signed with `key` (see the module's docstring).

    Made here, where torch is imported: its base class is torch's.
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class SignedBackend(RendezvousBackend):
        """torch's C10dRendezvousBackend (get_state / set_state with compare-and-set on one key), signed."""

        def __init__(self) -> None:
            self._store = store
            self._name = "torch.rendezvous." + run_id
            self._last_signed = NULL_STATE.encode()  # the last value here that was ours: put back over a forgery
            self._call("compare_set", self._name, "", NULL_STATE)

        @property
        def name(self) -> str:
            return BACKEND

        def get_state(self) -> tuple[bytes, Any] | None:
            return self._read(self._call("get", self._name))

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            if token and not isinstance(token, bytes):  # not one of ours: say what is there, as torch's does
                current = self.get_state()
                return None if current is None else (*current, False)
            expected = token if token else NULL_STATE.encode()
            now = self._read(self._call("compare_set", self._name, expected, sign(key, self._name, state)))
            return None if now is None else (now[0], now[1], now[0] == state)

        def _read(self, value: bytes) -> tuple[bytes, bytes] | None:
            """(state, token) of the value in the store, or None for no state; a forgery is replaced first."""
            for _ in range(RESTORE_ATTEMPTS):
                if value == NULL_STATE.encode():
                    return None
                state = verified(key, self._name, value)
                if state is not None:
                    self._last_signed = value
                    return state, value
                log.warning(  # the key's name is not said: it holds the run id, which stays out of logs
                    "cmlcluster: the rendezvous store held a state this run did not sign (%d bytes): someone "
                    "else reached the store. It was not read; the last signed state is put back",
                    len(value),
                )
                # Only if the forgery is still there: a node that put one back first wins, the others read it.
                value = self._call("compare_set", self._name, value, self._last_signed)
            raise RendezvousStateError(
                f"the rendezvous state was overwritten {RESTORE_ATTEMPTS} times in a row by someone who does "
                "not hold this run's key"
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
