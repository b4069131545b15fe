"""The control plane admits only holders of the session's keys (cmlcluster/control/connection.py).

Each test talks to a real session's controller with raw ZeroMQ sockets, once without a key (nothing
comes back) and once with the keys (something does, so the first silence means what it says).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq
from jupyter_client.session import Session as Signer

from cmlcluster import Session

pytestmark = pytest.mark.integration

MARKER = "cmlcluster-marker-4f1d"
PRINTS_FOR_A_WHILE = f"import time\nfor _ in range(300):\n    print('{MARKER}', flush=True)\n    time.sleep(0.05)\n"


def connection_info(session: Session, side: str) -> dict:
    with open(os.path.join(session.session_dir, "ipython", "security", f"ipcontroller-{side}.json")) as f:
        return json.load(f)


def with_curve(socket: zmq.Socket, server_key: str) -> zmq.Socket:
    public, secret = zmq.curve_keypair()  # a peer's own pair: ipyparallel's scheme
    socket.curve_serverkey = server_key.encode()
    socket.curve_publickey, socket.curve_secretkey = public, secret
    return socket


def received(socket: zmq.Socket, seconds: float, first: bool = False) -> list[list[bytes]]:
    """What comes within `seconds` (with first=True, returned as soon as something does)."""
    messages, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not (first and messages):
        if socket.poll(int(left * 1000)):
            messages.append(socket.recv_multipart())
    return messages


def raw_context() -> zmq.Context:
    """A context whose sockets never wait to send when closed: a socket closed with a message still queued
    (a peer that refused its handshake, or a loaded controller yet to read it) would otherwise hold
    term() until it is sent, and destroy(linger=0) cannot shorten the wait of a socket already closed
    (by its __del__, say: pyzmq #1407). ci42 waited there until the test's timeout."""
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    return context


@pytest.fixture
def printing_session():
    with Session("local", echo=False) as session:
        [worker] = session.launch_workers(1, cpu=0.5, memory=0.5, code=PRINTS_FOR_A_WHILE)
        assert session.await_workers([worker], wait_for_completion=False, timeout_seconds=60)["failures"] == []
        yield session
        session.stop_workers()


def test_the_output_relay_reads_nothing_to_a_subscriber_without_the_controllers_key(printing_session):
    info = connection_info(printing_session, "client")
    url = f"{info['interface']}:{info['iopub']}"
    context = raw_context()
    try:
        stranger = context.socket(zmq.SUB)
        stranger.setsockopt(zmq.SUBSCRIBE, b"")
        stranger.connect(url)
        holder = with_curve(context.socket(zmq.SUB), info["curve_serverkey"])
        holder.setsockopt(zmq.SUBSCRIBE, b"")
        holder.connect(url)
        assert received(stranger, 3) == []
        heard, deadline = b"", time.monotonic() + 60  # however loaded the machine
        while MARKER.encode() not in heard and time.monotonic() < deadline:
            heard += b"".join(part for message in received(holder, 1, first=True) for part in message)
        assert MARKER.encode() in heard  # the worker's output, for whoever holds the key
    finally:
        context.destroy(linger=0)


def test_requests_without_both_keys_get_no_answer(printing_session):
    info = connection_info(printing_session, "engine")
    url = f"{info['interface']}:{info['registration']}"  # where workers register, on their address
    right = Signer(key=info["key"].encode(), signature_scheme=info["signature_scheme"], packer="json", unpacker="json")
    wrong = Signer(key=os.urandom(16).hex().encode(), signature_scheme=info["signature_scheme"])
    context = raw_context()

    def answered(socket: zmq.Socket, signer: Signer, seconds: float) -> bool:
        socket.connect(url)
        signer.send(socket, "connection_request", content={})
        return bool(received(socket, seconds, first=True))

    try:
        assert not answered(context.socket(zmq.DEALER), right, 3)  # signed, not encrypted
        assert not answered(with_curve(context.socket(zmq.DEALER), info["curve_serverkey"]), wrong, 3)
        # Both keys: an answer, however loaded the machine (so that the two silences mean what they say).
        assert answered(with_curve(context.socket(zmq.DEALER), info["curve_serverkey"]), right, 60)
    finally:
        context.destroy(linger=0)
    # The worker was not disturbed by any of it.
    assert [w["status"] for w in printing_session.list_workers()] == ["running"]
