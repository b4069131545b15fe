"""A session controller's connection files: which channels listen where, and the keys that guard them.

ipyparallel's format (what ipcontroller writes, and reads back with reuse_files). The session
writes both files, 0600 in its 0700 folder, before the controller starts, so that workers can
start while it does.

Two keys per session guard the control plane:

- a 128-bit HMAC key signs every message: a peer without it cannot register an engine, call one,
  or be believed when it answers;
- a CurveZMQ key pair encrypts every connection: a peer without the controller's public key
  cannot complete the handshake, so it reads nothing (the output relay included) and sees no
  archive or pickled function pass. The controller alone holds the secret half; engines and the
  client make key pairs of their own (ipyparallel's scheme).

Whoever holds a worker's connection info (both keys) is as trusted as the notebook: it can run
code in every worker. The info reaches workers as data, never as a path on the session's machine.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

# The channels each side connects to. "broadcast" is a port per leaf scheduler for engines (2 at
# ipyparallel's default depth of 1), one for clients.
ENGINE_CHANNELS = ("control", "mux", "task", "iopub", "hb_ping", "hb_pong", "broadcast", "broadcast")
CLIENT_CHANNELS = ("control", "mux", "task", "iopub", "notification", "broadcast")

# The session's own client is in the session's process, so the controller's client channels (every
# worker's output relayed, calls to any worker) listen on loopback, whatever address workers reach.
CLIENT_IP = "127.0.0.1"

# Whether new sessions encrypt (CurveZMQ). Always, but for bench/control_plane_keys.py, which
# turns it off in its own process to measure what encryption costs.
ENCRYPT = True


@dataclass(frozen=True, repr=False)
class Keys:
    """A session's control-plane secrets (repr=False: never in a log or a traceback's locals)."""

    signing: str  # HMAC-SHA256 key, hex
    curve_public: str  # the controller's CurveZMQ public key, Z85 (what engines and the client need); "": none
    curve_secret: str  # its secret half, Z85: the controller's alone

    @classmethod
    def new(cls) -> Keys:
        if not ENCRYPT:
            return cls(secrets.token_hex(16), "", "")
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(secrets.token_hex(16), public.decode("ascii"), secret.decode("ascii"))

    def controller_args(self) -> list[str]:
        """The controller's command-line switch for encryption (its keys go in controller_env)."""
        return ["--IPController.enable_curve=True"] if self.curve_public else []

    def controller_env(self) -> dict[str, str]:
        """What the controller process reads its CurveZMQ key pair from (ipyparallel's own variables):
        its environment, which only its user may read, not its command line."""
        if not self.curve_public:
            return {}
        return {"IPP_CURVE_PUBLICKEY": self.curve_public, "IPP_CURVE_SECRETKEY": self.curve_secret}


def connection_files(ip: str, ports: list[int], keys: Keys) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine and client connection info of a controller whose workers reach it on `ip`: a
    registration port, then one port per ENGINE_CHANNELS and CLIENT_CHANNELS entry, in that order.

    Engine channels listen on `ip`, client channels on CLIENT_IP; the registration port on both
    (ipyparallel binds it on each address when they differ)."""
    registration, rest = ports[0], iter(ports[1:])
    shared = {
        "ssh": "",
        "registration": registration,
        "key": keys.signing,
        "curve_serverkey": keys.curve_public or None,
        "pack": "json",
        "unpack": "json",
        "signature_scheme": "hmac-sha256",
    }
    engine: dict[str, Any] = {"interface": f"tcp://{ip}", "location": ip}
    for channel in ENGINE_CHANNELS:
        port = next(rest)
        if channel == "broadcast":
            engine.setdefault(channel, []).append(port)
        else:
            engine[channel] = port
    # The client's location is this machine: its own loopback (ipyparallel would otherwise look for the
    # controller's address among this machine's addresses, a list it reads once, and warn).
    client: dict[str, Any] = {"interface": f"tcp://{CLIENT_IP}", "location": CLIENT_IP, "task_scheme": "leastload"}
    for channel in CLIENT_CHANNELS:
        client[channel] = next(rest)
    return {**engine, **shared}, {**client, **shared}


def write_private(path: str, content: dict[str, Any]) -> None:
    """`content` as JSON in a file only this user may read or write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(content, f, indent=2)
